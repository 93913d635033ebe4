"""A watched connection: its deadlines, its cancel scope, and the stream that stamps it.

:class:`Watch` is what ``keeper.watch(...)`` returns: a ``with`` block whose cancel
scope the keeper's reaper cancels when a deadline passes. Given a stream, the watch
is a :class:`WatchedStream`, a Watch that is also a ``trio.abc.Stream`` over it (a
:class:`HalfCloseableWatchedStream` over a half-closeable one), whose every
``receive_some`` and ``send_all`` records activity with a single attribute store
(see :mod:`idlekeeper.epochs`). One object, not two, so that the store does not
first chase a pointer to another object.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol

import trio

from .deadlines import ConnectionDeadlines, Reason
from .epochs import NEVER, Epoch, EpochClock, Stamp, latest
from .stall import SocketLike

__all__ = ["ExpireHook", "LastWords", "Watch", "WatchState", "WatchedStream"]

logger = logging.getLogger("idlekeeper")

LastWords = Callable[[Reason], "bytes | None"]
"""``last_words(reason)``: what a :class:`WatchedStream` sends just before an expiry's close."""

ExpireHook = Callable[["Watch"], Awaitable[None] | None]
"""``on_expire(watch)``: a plain function or an async one, run in the trio thread
(see :func:`~idlekeeper.open_keeper`), or one wrapped in :class:`~idlekeeper.in_thread`."""

# A pending send larger than this is fed to the transport in pieces, each of which
# stamps progress: "between two successful writes", as nginx's send_timeout, rather
# than "for the whole response".
SEND_CHUNK = 64 * 1024


class WatchState(enum.Enum):
    """Where a watch is in its life. It moves forward only, once."""

    NEW = "new"
    """Created; its deadlines are not kept yet."""
    WATCHING = "watching"
    """Inside its ``with`` block (or between :meth:`Watch.start` and :meth:`Watch.stop`)."""
    DONE = "done"
    """Left, or ended by its keeper's close; the keeper has forgotten it."""


# Bits of Watch._flags: the first two fixed when the watch is made, the others set later.
CLOSE_ON_EXPIRY = 1
STALL_CHECK = 2
ENDED_BY_CLOSE = 4
CANCELLED = 8
# The absolute deadline has had its one grace after a stall (see Keeper._due); a new
# deadline gets one again.
GRACED = 16

# Module globals: the keeper tests the state on every deadline change, and a global
# is one dictionary look-up where ``WatchState.WATCHING`` is two.
_NEW = WatchState.NEW
_WATCHING = WatchState.WATCHING
_DONE = WatchState.DONE


class _Owner(Protocol):
    """What a watch needs from its keeper (kept abstract to avoid an import cycle)."""

    _epochs: EpochClock

    def _enter(self, watch: Watch) -> None: ...

    def _exit(self, watch: Watch) -> None: ...

    def _changed(self, watch: Watch) -> None: ...

    def _timeout_set(self, watch: Watch, seconds: float) -> None: ...


def find_socket(stream: trio.abc.Stream | None) -> trio.socket.SocketType | None:
    """The socket under a stream, following ``transport_stream`` (SSLStream, wrappers)."""
    seen = 0
    current: object = stream
    while current is not None and seen < 16:
        sock = getattr(current, "socket", None)
        if isinstance(sock, trio.socket.SocketType):
            return sock
        current = getattr(current, "transport_stream", None)
        seen += 1
    return None


class Watch(ConnectionDeadlines):
    """One connection under a keeper's watch. Use it as a ``with`` block.

    Inside the block, the connection's deadlines are live; when one passes, the
    block's cancel scope is cancelled (and, with ``close=True``, the socket closed).
    After the block, :attr:`expired` and :attr:`reason` say why it ended.

    The timeouts are attributes: assign a number of seconds, or None to clear, as
    the protocol changes phase. Each counts from its last activity or from the
    assignment, whichever is later. :attr:`deadline` is absolute (trio time).
    """

    __slots__ = (
        "_owner",
        "_scope",
        "_socket",
        "_flags",
        "on_expire",
        "_expiry",
        "_state",
        "_entered",
    )

    def __init__(
        self,
        owner: _Owner,
        socket: SocketLike | None,
        *,
        close: bool,
        stall_check: bool,
        on_expire: ExpireHook | None,
    ) -> None:
        super().__init__()
        # The epochs are the owner's (one clock a trio run): reached through it, not
        # held in a slot of each watch's own.
        self._owner = owner
        # Made when first needed: a connection served without a task of its own never
        # enters one, and a scope is a few hundred bytes of each of a million watches.
        self._scope: trio.CancelScope | None = None
        self._socket = socket
        # Two booleans in one slot: a slot more would carry every watch over one of
        # the allocator's 16-byte size classes, and a million watches walked by the
        # reaper cost ~10% more CPU for it (BENCHMARKS.md, issue 8's before/after).
        self._flags = (CLOSE_ON_EXPIRY if close else 0) | (STALL_CHECK if stall_check else 0)
        self.on_expire = on_expire
        """Called once if the connection expires; see :data:`ExpireHook`."""
        # Why and how late it expired, in one slot: set once, and a slot less keeps a
        # dense engine's transport in a smaller size class of the allocator.
        self._expiry: tuple[Reason, float] | None = None
        self._state = _NEW
        # The loop pass in which watching began: silence is counted from it until the
        # first receive. An epoch shared with the pass's other connections, not a float.
        self._entered: Epoch = NEVER

    # -- the block ---------------------------------------------------------------

    def __enter__(self) -> Watch:
        if self._state is not _NEW:
            raise RuntimeError("a Watch can be entered only once")
        # Started first: a closed keeper refuses it, and the scope must not be
        # entered then, since nothing would exit it.
        self.start()
        self.cancel_scope.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.stop()
        return self.cancel_scope.__exit__(exc_type, exc, tb)

    def start(self) -> None:
        """Begin keeping this watch's deadlines without a ``with`` block.

        For connections served without a task of their own (one loop driving many
        sockets): an expiry then closes the socket (with ``close=True``) and runs
        ``on_expire``, and :attr:`cancel_scope` is simply never entered. Pair it
        with :meth:`stop`. The ``with`` block calls both for you.
        """
        if self._state is not _NEW:
            raise RuntimeError("a Watch can be started only once")
        self._state = _WATCHING
        self._entered = self._owner._epochs.current
        try:
            self._owner._enter(self)
        except BaseException:
            self._state = _DONE
            raise

    def stop(self) -> None:
        """Stop keeping this watch's deadlines; the keeper forgets it. Idempotent."""
        if self._state is _WATCHING:
            self._state = _DONE
            self._owner._exit(self)
        else:
            self._state = _DONE

    @property
    def state(self) -> WatchState:
        """Where this watch is in its life."""
        return self._state

    @property
    def active(self) -> bool:
        """Being watched (inside the ``with`` block) and not expired."""
        return self._state is _WATCHING and self._expiry is None

    @property
    def expired(self) -> bool:
        """Whether a deadline ended the connection."""
        return self._expiry is not None

    @property
    def reason(self) -> Reason | None:
        """Why the connection expired, or None."""
        expiry = self._expiry
        return None if expiry is None else expiry[0]

    @property
    def lag(self) -> float:
        """How long after its deadline the expiry ran (seconds); 0 if it has not."""
        expiry = self._expiry
        return 0.0 if expiry is None else expiry[1]

    @property
    def cancel_scope(self) -> trio.CancelScope:
        """The scope the keeper cancels on expiry."""
        if self._scope is None:
            self._scope = trio.CancelScope()
            if self._flags & CANCELLED:
                self._scope.cancel()
        return self._scope

    @property
    def stream(self) -> WatchedStream:
        """This watch as a stream (only if it was given one: it is then a WatchedStream)."""
        if not isinstance(self, WatchedStream):
            raise AttributeError("this Watch was created without a stream")
        return self

    @property
    def socket(self) -> SocketLike | None:
        """The socket used for stall checks and closing, if any."""
        return self._socket

    # -- deadlines, as assignable attributes ----------------------------------------

    @property
    def idle_timeout(self) -> float | None:
        """Seconds without activity in either direction, or None."""
        return self._idle

    @idle_timeout.setter
    def idle_timeout(self, seconds: float | None) -> None:
        self._set_idle_timeout(seconds, self._owner._epochs.current)
        if seconds is not None:  # None only removes a deadline: the filing stands
            self._owner._timeout_set(self, seconds)

    @property
    def receive_timeout(self) -> float | None:
        """Seconds without receiving anything, or None."""
        return self._receive

    @receive_timeout.setter
    def receive_timeout(self, seconds: float | None) -> None:
        self._set_receive_timeout(seconds, self._owner._epochs.current)
        if seconds is not None:  # None only removes a deadline: the filing stands
            self._owner._timeout_set(self, seconds)

    def receive_timeout_since(self, seconds: float | None, since: float) -> None:
        """Set the receive timeout counting from ``since`` instead of from now.

        For a protocol whose keep-alive counts from a packet already received (MQTT's
        counts from the CONNECT): that packet may have been handled a while after it
        came, and counting from then would find a peer that falls silent after it
        late by as much. ``since`` is clamped to no earlier than the last receive (or
        than watching began, if nothing was received) and no later than now, so the
        deadline is never earlier than the timeout allows.
        """
        now = trio.current_time()
        base = self._rx if self._rx is not NEVER else self._entered
        stamp: Stamp
        if base is NEVER or since >= now:
            stamp = self._owner._epochs.current
        elif since <= latest(base, now):
            # From the receive (or the start) itself: its stamp, not a float of its own.
            stamp = base
        else:
            stamp = since
        self._set_receive_timeout(seconds, stamp)
        self._owner._changed(self)

    @property
    def send_timeout(self) -> float | None:
        """Seconds a pending send may go without progress, or None."""
        return self._send

    @send_timeout.setter
    def send_timeout(self, seconds: float | None) -> None:
        self._set_send_timeout(seconds, self._owner._epochs.current)
        if seconds is not None:  # None only removes a deadline: the filing stands
            self._owner._timeout_set(self, seconds)

    @property
    def deadline(self) -> float:
        """Absolute trio time at which the connection ends; ``inf`` for none."""
        return self._deadline

    @deadline.setter
    def deadline(self, when: float | None) -> None:
        self._set_deadline(when)
        self._flags &= ~GRACED
        self._owner._changed(self)

    # -- activity by hand, for connections that are not read through .stream -------

    def mark_received(self) -> None:
        """Record that something was received now."""
        self._rx = self._owner._epochs.current

    def mark_sent(self) -> None:
        """Record that a send made progress now."""
        self._tx = self._owner._epochs.current

    def touch(self) -> None:
        """Record activity in both directions."""
        self._rx = self._tx = self._owner._epochs.current

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the peer was last heard from (since watching began, if never).

        Activity is stamped per loop pass, so this can err short by the length of the
        pass the last receive happened in, never long: a silence reported is one that
        really lasted. ``now`` defaults to ``trio.current_time()``; 0 before watching.
        """
        if now is None:
            now = trio.current_time()
        since = self._rx if self._rx is not NEVER else self._entered
        if since is NEVER:
            return 0.0
        return max(0.0, now - latest(since, now))

    # -- used by the keeper ------------------------------------------------------------

    def cancel(self) -> None:
        """End the watched block from outside, as an expiry does but with no reason:
        cancel its scope and, if the watch closes on expiry, close its socket
        (a takeover or a shutdown, say). Synchronous and O(1)."""
        self._flags |= CANCELLED
        # Not made here for a watch kept without a block (half a mass expiry's cost):
        if self._scope is not None:  # a scope asked for later comes cancelled
            self._scope.cancel()
        if self._flags & CLOSE_ON_EXPIRY and self._socket is not None:
            close = getattr(self._socket, "close", None)
            if close is not None:
                close()

    def _first_deadlines(
        self,
        idle: float | None,
        receive: float | None,
        send: float | None,
        deadline: float | None,
        max_age: float | None,
        now: float,
    ) -> None:
        """Set a new watch's first deadlines (before it is started: nothing is filed yet)."""
        if idle is not None:
            self._set_idle_timeout(idle, now)
        if receive is not None:
            self._set_receive_timeout(receive, now)
        if send is not None:
            self._set_send_timeout(send, now)
        when = math.inf if deadline is None else deadline
        if max_age is not None:
            when = min(when, now + max_age)
        self._set_deadline(when)

    def _end_by_close(self) -> bool:
        """The keeper is closing: cancel this watch if it is live. Returns whether it was."""
        if not self.active:
            return False
        self._state = _DONE
        self._flags |= ENDED_BY_CLOSE
        self.cancel()
        return True

    def _expire(self, reason: Reason, lag: float) -> None:
        self._expiry = (reason, lag)
        self.cancel()

    def __repr__(self) -> str:
        state = self._state.value
        if self.reason is not None:
            state = f"expired ({self.reason})"
        return f"<Watch {state} idle={self._idle} receive={self._receive} send={self._send} deadline={self._deadline}>"


class WatchedStream(Watch, trio.abc.Stream):
    """A :class:`Watch` that is also a stream, recording activity as data moves.

    ``with keeper.watch(stream, ...) as conn:`` gives one: read and write ``conn``
    as you would ``stream``; change ``conn.idle_timeout`` and friends as the
    protocol changes phase; ``async with conn`` (or ``conn.aclose()``) closes it.
    Works over any ``trio.abc.Stream``: ``SocketStream``, ``SSLStream``, a memory
    stream in a test. Over a ``trio.abc.HalfCloseableStream`` (a ``SocketStream``)
    the watch is a :class:`HalfCloseableWatchedStream`, with ``send_eof``; over
    another (an ``SSLStream``) it is not one, so code that asks ``isinstance(s,
    trio.abc.HalfCloseableStream)``, as ``trio.StapledStream`` does, gets the truth.
    """

    __slots__ = ("transport_stream", "last_words")

    def __init__(
        self,
        owner: _Owner,
        transport_stream: trio.abc.Stream,
        socket: SocketLike | None,
        *,
        close: bool,
        stall_check: bool,
        on_expire: ExpireHook | None,
    ) -> None:
        super().__init__(owner, socket, close=close, stall_check=stall_check, on_expire=on_expire)
        self.transport_stream = transport_stream
        """The wrapped stream."""
        self.last_words: LastWords | None = None
        """Asked when a deadline expires, just before the close: the bytes to send the
        peer first (MQTT 5's DISCONNECT 0x8D), or None. As the dense engine's
        :meth:`~idlekeeper.Protocol.last_words`: written without waiting, and only if no
        send is under way and the watch closes on expiry. Over a ``trio.SocketStream``
        only: under TLS the socket carries records, which the reaper cannot make."""

    def _expire(self, reason: Reason, lag: float) -> None:
        words, sock = self.last_words, self._socket
        plain = isinstance(self.transport_stream, trio.SocketStream)
        if words is not None and sock is not None and plain and not self._sending and self._flags & CLOSE_ON_EXPIRY:
            try:
                data = words(reason)
                if data:
                    with contextlib.suppress(OSError):  # gone, or a full buffer: the close follows anyway
                        os.write(sock.fileno(), data)
            except Exception:
                logger.exception("idlekeeper: last_words of %r raised", self)
        super()._expire(reason, lag)

    @property
    def watch(self) -> WatchedStream:
        """The watch whose deadlines this stream's activity refreshes: itself."""
        return self

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """Receive from the transport; a return (data or EOF) counts as receive activity."""
        data = await self.transport_stream.receive_some(max_bytes)
        self._rx = self._owner._epochs.current
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send everything; each piece the transport accepts counts as send progress."""
        epochs = self._owner._epochs
        self._tx = epochs.current
        self._sending = True
        try:
            if len(data) <= SEND_CHUNK:
                await self.transport_stream.send_all(data)
            else:
                view = memoryview(data).cast("B")
                for start in range(0, len(view), SEND_CHUNK):
                    await self.transport_stream.send_all(view[start : start + SEND_CHUNK])
                    self._tx = epochs.current
        finally:
            self._sending = False
        self._tx = epochs.current

    async def wait_send_all_might_not_block(self) -> None:
        """Pass through to the transport."""
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the transport. After an expiry that already closed it, this is quiet."""
        try:
            await self.transport_stream.aclose()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if not (self.expired or self._flags & ENDED_BY_CLOSE):
                raise


class HalfCloseableWatchedStream(WatchedStream, trio.abc.HalfCloseableStream):
    """A :class:`WatchedStream` over a half-closeable stream, with ``send_eof``."""

    __slots__ = ()

    transport_stream: trio.abc.HalfCloseableStream

    async def send_eof(self) -> None:
        """Half-close the transport."""
        await self.transport_stream.send_eof()
