"""The dense engine: many connections served by one trio task, with no task per connection.

A task per connection is the natural way to write a trio server, and each costs
several kilobytes of trio's machinery (task, cancel scopes, stream objects). Where
connections are many and mostly idle (a million IoT devices that send two bytes
every few minutes), that machinery is most of the server's memory and much of
its CPU. The engine serves the same connections as plain objects:

- non-blocking sockets on an epoll set of the engine's own; trio waits for the
  set's descriptor to be readable (``trio.lowlevel.wait_readable``), so the engine
  is one ordinary task and the rest of the program (status endpoint, coordinator,
  the keeper's reaper) goes on beside it;
- each pass takes up to ``max_events`` ready sockets from the set in one system
  call, reads each once, and drains each ready listener in a batch of accepts;
- writes go straight to the kernel, and only what it does not take is queued,
  with write-readiness asked for only while something is queued;
- each connection is a :class:`~idlekeeper.transport.Transport`, a
  :class:`~idlekeeper.Watch` filed in the keeper's one wheel: the same deadlines,
  the same stall check, the same reaper, and the same guarantees as a watched
  stream.

The engine calls a :class:`~idlekeeper.protocol.Protocol`'s methods; they run in
the engine's task and must not block. Linux only (epoll).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import NoReturn

import trio

from . import arrival as _arrival
from .epochs import Epoch
from .keeper import Keeper
from .protocol import EngineClosed, Protocol
from .transport import CLOSED, EOF_SENT, NO_READ, PEER_EOF, Transport
from .watch import ExpireHook

__all__ = ["Engine", "open_engine", "serve_protocol"]

logger = logging.getLogger("idlekeeper.engine")

ProtocolFactory = Callable[[], Protocol]
"""Makes the protocol object of each accepted connection."""

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
# Registration bits kept in Transport._io beside the transport's own.
_REG_IN = 1 << 8
_REG_OUT = 1 << 9
_REG = _REG_IN | _REG_OUT

# Running out of descriptors or kernel memory is a state that passes; trio's
# serve_listeners waits 100 ms and tries again, and so does the engine.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_PAUSE = 0.1
# The connection died between the kernel's accept queue and our accept: try the next.
_HARMLESS_ACCEPT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


class _Listener:
    """A listening socket and how to serve what it accepts."""

    __slots__ = ("sock", "factory", "idle", "receive", "send", "max_age", "on_expire", "paused")

    def __init__(
        self,
        sock: socket.socket,
        factory: ProtocolFactory,
        idle: float | None,
        receive: float | None,
        send: float | None,
        max_age: float | None,
        on_expire: ExpireHook | None,
    ) -> None:
        self.sock = sock
        self.factory = factory
        self.idle = idle
        self.receive = receive
        self.send = send
        self.max_age = max_age
        self.on_expire = on_expire
        self.paused = False


class Engine:
    """One epoll set and one trio task serving many connections; see the module.

    Create it with :func:`open_engine`; hand it listeners with :meth:`serve`.
    All methods are synchronous.
    """

    def __init__(
        self,
        keeper: Keeper,
        *,
        read_size: int,
        max_events: int,
        accept_batch: int,
        high_water: int,
        low_water: int,
        coalesce: float = 0.0,
    ) -> None:
        if not 0 <= low_water <= high_water:
            raise ValueError("need 0 <= low_water <= high_water")
        if coalesce < 0:
            raise ValueError("coalesce must be >= 0")
        self.keeper = keeper
        self.coalesce = coalesce
        """Seconds traffic is gathered between passes while it keeps coming (0: a pass per wake-up)."""
        # A gathered packet is read up to a window after it came; stamping it then
        # would move its receive deadline out by as much, so it is stamped with when
        # the kernel received it.
        self.arrivals: _arrival.ArrivalClock | None = _arrival.ArrivalClock(trio.current_time) if coalesce else None
        """Turns kernel receive stamps into keeper time (only while coalescing)."""
        self.read_size = read_size
        self.max_events = max_events
        self.accept_batch = accept_batch
        self.high_water = high_water
        """Queued bytes above which a peer stops being read (and ``pause_writing``)."""
        self.low_water = low_water
        """Queued bytes at or below which reading resumes (and ``resume_writing``)."""
        self._epoll = select.epoll()
        # What must not wait out a coalescing window (listeners, the wake-up socket) is
        # in a set of its own, itself a member of the main set: while gathering, the
        # engine waits on this one alone. A ramp of connections paced by the window
        # would overflow the kernel's accept queue, and dropped SYNs come back only
        # after the client's retransmission timeout (1 s, then 3, 7...).
        self._urgent = select.epoll()
        self._fds: dict[int, Transport] = {}
        self._epoll.register(self._urgent.fileno(), _IN)
        self._listeners: list[_Listener] = []
        self._lost: list[tuple[Transport, BaseException | None]] = []
        # Wakes the engine when a connection is dropped from outside its pass (an
        # expiry in the reaper, a takeover in another task): its protocol must hear.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._urgent.register(self._wake_r.fileno(), _IN)
        self._woken = False
        self._backlog = False
        self._in_pass = False
        self._closed = False
        self.accepted = 0
        """Connections accepted."""
        self.accept_errors = 0
        """Accepts that failed for lack of descriptors or memory (each pauses accepting)."""
        self.callback_errors = 0
        """Protocol callbacks that raised (each closed its connection)."""
        self.passes = 0
        """Passes of the engine's loop."""

    # -- public ----------------------------------------------------------------------

    def serve(
        self,
        listeners: Sequence[socket.socket | trio.SocketListener],
        factory: ProtocolFactory,
        *,
        idle: float | None = None,
        receive: float | None = None,
        send: float | None = None,
        max_age: float | None = None,
        on_expire: ExpireHook | None = None,
    ) -> list[socket.socket]:
        """Accept connections on ``listeners``, each served by a ``factory()`` protocol.

        The deadlines are where every connection starts (as with
        :func:`~idlekeeper.serve_listeners`); the protocol changes them on its
        transport. A trio listener's socket is taken over by the engine. Returns
        the listening sockets.
        """
        if self._closed:
            raise RuntimeError("this engine is closed")
        out = []
        for listener in listeners:
            sock = listener if isinstance(listener, socket.socket) else socket.socket(fileno=listener.socket.detach())
            sock.setblocking(False)
            entry = _Listener(sock, factory, idle, receive, send, max_age, on_expire)
            self._listeners.append(entry)
            self._urgent.register(sock.fileno(), _IN)
            out.append(sock)
        return out

    def close_listeners(self) -> None:
        """Stop accepting; connections already accepted go on."""
        for entry in self._listeners:
            fd = entry.sock.fileno()
            if fd >= 0:
                if not entry.paused:
                    self._urgent.unregister(fd)
                entry.sock.close()
        self._listeners.clear()

    @property
    def listeners(self) -> list[socket.socket]:
        """The listening sockets still open."""
        return [entry.sock for entry in self._listeners]

    def __len__(self) -> int:
        """Open connections."""
        return len(self._fds)

    def transports(self) -> Iterator[Transport]:
        """Every open connection (a snapshot)."""
        return iter(list(self._fds.values()))

    def adopt(
        self,
        sock: socket.socket,
        protocol: Protocol,
        *,
        idle: float | None = None,
        receive: float | None = None,
        send: float | None = None,
        max_age: float | None = None,
        on_expire: ExpireHook | None = None,
    ) -> Transport:
        """Serve a connected socket (made or accepted elsewhere) with ``protocol``.

        The socket is made non-blocking: a blocking send would stall the engine's task.
        """
        if self._closed:
            raise RuntimeError("this engine is closed")
        sock.setblocking(False)
        return self._start(sock, protocol, idle, receive, send, max_age, on_expire)

    # -- the loop ----------------------------------------------------------------------

    async def _run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        epfd = self._epoll.fileno()
        coalesce = self.coalesce
        task_status.started()
        while True:
            await trio.lowlevel.wait_readable(epfd)
            handled = self._guarded_pass()
            # Interrupt moderation: while traffic trickles in, a wake-up of trio's loop
            # per packet costs far more than the packet; gather for ``coalesce`` seconds
            # and serve what came in one pass, until a pass finds nothing.
            while coalesce and handled:
                if self._backlog:
                    # A listener had more waiting than a pass accepts: accepting must not
                    # be paced by the window (a ramp would queue in the kernel's backlog).
                    await trio.lowlevel.checkpoint()
                else:
                    await self._gather(coalesce)
                handled = self._guarded_pass()

    async def _gather(self, seconds: float) -> None:
        """Wait out a coalescing window; end it early for a connection to accept.

        Drops from outside a pass (an expiry, a takeover) are told to their protocols
        as they happen, not a window later: that is when a presence server says
        "offline".
        """
        now = trio.current_time()
        # One wake-up for the window's end and the reaper's: the window may end up to
        # half of it early (replies only come sooner).
        urgent = self._urgent.fileno()
        with self.keeper.shared_wakeup(now + seconds, now + seconds / 2):
            while True:
                await trio.lowlevel.wait_readable(urgent)
                if self._urgent_pass():
                    return

    def _guarded_pass(self) -> int:
        self._in_pass = True
        try:
            return self._pass()
        finally:
            self._in_pass = False

    def _urgent_pass(self) -> bool:
        """While gathering: tell drops; True if a listener is ready (the window ends)."""
        self._in_pass = True
        try:
            ready = self._poll_urgent()
            self._deliver_lost()
        finally:
            self._in_pass = False
        return bool(ready)

    def _poll_urgent(self) -> list[_Listener]:
        """Drain wake-ups and return the listeners with connections waiting."""
        ready: list[_Listener] = []
        wake = self._wake_r.fileno()
        for fd, _events in self._urgent.poll(0):
            if fd == wake:
                self._drain_wakeups()
            else:
                ready.extend(entry for entry in self._listeners if entry.sock.fileno() == fd)
        return ready

    def _pass(self) -> int:
        self.passes += 1
        if self.arrivals is not None:
            self.arrivals.calibrate()
        fds = self._fds
        urgent = self._urgent.fileno()
        ready: list[_Listener] = []
        polled = self._epoll.poll(0, self.max_events)
        for fd, events in polled:
            entry = fds.get(fd)
            if entry is not None:
                if events & _OUT and entry._wbuf is not None:
                    entry._flush()
                if events & ~_OUT and not entry._io & NO_READ:
                    self._read(entry)
            elif fd == urgent:
                # Accepts come after the reads, so that a descriptor freed in this pass
                # and reused by an accept cannot be handed an event meant for the old socket.
                ready = self._poll_urgent()
        self._deliver_lost()
        # A full batch of events means more may be ready: like a listener's backlog,
        # that is served now, not a coalescing window later (where it would pile up).
        backlog = len(polled) >= self.max_events
        for listener in ready:
            backlog |= self._accept(listener)
        self._backlog = backlog
        self._deliver_lost()
        return len(polled)

    def _read(self, t: Transport) -> None:
        arrivals = self.arrivals
        try:
            if arrivals is None:
                data = t._socket.recv(self.read_size)
                at = None
            else:
                data, ancillary, _flags, _addr = t._socket.recvmsg(self.read_size, _arrival.ANCILLARY_SIZE)
                at = arrivals.arrival(ancillary)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(t, exc)
            return
        t.rx = t._epochs.current if at is None else Epoch(at)
        protocol = t._protocol
        if protocol is None:
            return
        try:
            if data:
                protocol.data_received(data)
                return
            t._io |= PEER_EOF
            self._update(t)
            if not protocol.eof_received() or t._io & EOF_SENT:
                t.close()
        except Exception as exc:
            self.callback_errors += 1
            logger.exception("idlekeeper: protocol %r raised; closing its connection", protocol)
            self._drop(t, exc)

    def _accept(self, listener: _Listener) -> bool:
        """Accept up to a batch; True if the batch ran out before the backlog did."""
        sock = listener.sock
        for _ in range(self.accept_batch):
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if exc.errno in _HARMLESS_ACCEPT_ERRNOS:
                    continue
                self.accept_errors += 1
                if exc.errno not in _RESOURCE_ERRNOS:
                    logger.error("idlekeeper: accept failed: %s; pausing accepts", exc)
                else:
                    logger.warning("idlekeeper: accept failed: %s; pausing accepts for %ss", exc, _ACCEPT_PAUSE)
                self._pause_listener(listener)
                return False
            self.accepted += 1
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                protocol = listener.factory()
            except Exception:
                self.callback_errors += 1
                logger.exception("idlekeeper: protocol factory %r raised", listener.factory)
                conn.close()
                continue
            self._start(
                conn, protocol, listener.idle, listener.receive, listener.send, listener.max_age, listener.on_expire
            )
        return True

    def _start(
        self,
        sock: socket.socket,
        protocol: Protocol,
        idle: float | None,
        receive: float | None,
        send: float | None,
        max_age: float | None,
        on_expire: ExpireHook | None,
    ) -> Transport:
        keeper = self.keeper
        t = Transport(keeper, self, sock, stall_check=keeper._stall_check, on_expire=on_expire)
        keeper._configure(t, idle, receive, send, None, max_age)
        t._protocol = protocol
        if self.arrivals is not None:
            _arrival.enable(sock)
        fd = sock.fileno()
        self._fds[fd] = t
        self._epoll.register(fd, _IN)
        t._io |= _REG_IN
        t.start()
        try:
            protocol.connection_made(t)
        except Exception as exc:
            self.callback_errors += 1
            logger.exception("idlekeeper: connection_made of %r raised", protocol)
            self._drop(t, exc)
        return t

    def _pause_listener(self, listener: _Listener) -> None:
        if listener.paused:
            return
        listener.paused = True
        self._urgent.unregister(listener.sock.fileno())
        self.keeper.call_later(_ACCEPT_PAUSE, self._resume_listener, listener)

    def _resume_listener(self, listener: _Listener) -> None:
        if listener.paused and listener.sock.fileno() >= 0:
            listener.paused = False
            self._urgent.register(listener.sock.fileno(), _IN)

    # -- called by transports ----------------------------------------------------------

    def _update(self, t: Transport) -> None:
        """Bring the socket's epoll registration in line with what the transport wants."""
        io = t._io
        if io & CLOSED:
            return
        want = (0 if io & NO_READ else _REG_IN) | (0 if t._wbuf is None else _REG_OUT)
        have = io & _REG
        if want == have:
            return
        fd = t._socket.fileno()
        mask = (_IN if want & _REG_IN else 0) | (_OUT if want & _REG_OUT else 0)
        # Nothing wanted means out of the set: a hung-up socket would otherwise be
        # reported on every pass (epoll always reports hang-ups).
        if not want:
            self._epoll.unregister(fd)
        elif not have:
            self._epoll.register(fd, mask)
        else:
            self._epoll.modify(fd, mask)
        t._io = (io & ~_REG) | want

    def _drop(self, t: Transport, exc: BaseException | None) -> None:
        """Close a connection now; its protocol hears of it on the engine's next pass.

        Synchronous and O(1), so that the reaper can call it (through an expiry).
        """
        io = t._io
        if io & CLOSED:
            return
        t._io = (io | CLOSED) & ~_REG
        sock = t._socket
        fd = sock.fileno()
        if io & _REG:
            self._epoll.unregister(fd)
        if self._fds.get(fd) is t:
            del self._fds[fd]
        sock.close()
        t._wbuf = None
        t.sending = False
        t.stop()
        self._lost.append((t, exc))
        if self._in_pass:
            return
        if not self._woken:
            self._woken = True
            with contextlib.suppress(BlockingIOError):  # already full of wake-ups
                self._wake_w.send(b"\0")

    def _drain_wakeups(self) -> None:
        self._woken = False
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _deliver_lost(self) -> None:
        while self._lost:
            batch, self._lost = self._lost, []
            for t, exc in batch:
                protocol, t._protocol = t._protocol, None
                if protocol is None:
                    continue
                try:
                    protocol.connection_lost(exc)
                except Exception:
                    self.callback_errors += 1
                    logger.exception("idlekeeper: connection_lost of %r raised", protocol)

    def _close(self) -> None:
        self._closed = True
        self.close_listeners()
        for t in list(self.transports()):
            self._drop(t, EngineClosed())
        self._deliver_lost()
        self._epoll.close()
        self._urgent.close()
        self._wake_r.close()
        self._wake_w.close()


@asynccontextmanager
async def open_engine(
    keeper: Keeper,
    *,
    read_size: int = 64 * 1024,
    max_events: int = 1024,
    accept_batch: int = 256,
    high_water: int = 256 * 1024,
    low_water: int = 64 * 1024,
    coalesce: float = 0.0,
) -> AsyncIterator[Engine]:
    """Start a dense engine (one task) whose connections ``keeper`` watches.

    When the block exits, listeners close and every connection is closed, its
    protocol told :class:`~idlekeeper.protocol.EngineClosed`. ``read_size`` is the
    most one read takes; ``max_events`` the most ready sockets one pass handles;
    ``accept_batch`` the most connections one pass accepts per listener.
    ``coalesce`` (seconds, default 0) trades latency for CPU: while packets keep
    arriving, the engine serves them in one pass every ``coalesce`` seconds instead
    of one wake-up of trio's loop each; every reply waits up to that long. Receive
    deadlines do not move with it: each read is stamped with when the kernel received
    its bytes (:mod:`idlekeeper.arrival`), so a silent peer is found as soon as
    without coalescing.
    """
    engine = Engine(
        keeper,
        read_size=read_size,
        max_events=max_events,
        accept_batch=accept_batch,
        high_water=high_water,
        low_water=low_water,
        coalesce=coalesce,
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine._run)
            try:
                yield engine
            finally:
                nursery.cancel_scope.cancel()
    finally:
        engine._close()


async def serve_protocol(
    factory: ProtocolFactory,
    port: int,
    *,
    keeper: Keeper,
    host: str | bytes | None = None,
    backlog: int | None = None,
    idle: float | None = None,
    receive: float | None = None,
    send: float | None = None,
    max_age: float | None = None,
    on_expire: ExpireHook | None = None,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve TCP on ``port`` with a dense engine, one ``factory()`` protocol per connection.

    The dense counterpart of :func:`~idlekeeper.serve_tcp`; compatible with
    ``nursery.start``, which returns the :class:`Engine` (port 0 picks a free port:
    ``engine.listeners[0].getsockname()[1]``).
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    async with open_engine(keeper) as engine:
        engine.serve(listeners, factory, idle=idle, receive=receive, send=send, max_age=max_age, on_expire=on_expire)
        task_status.started(engine)
        await trio.sleep_forever()
    raise AssertionError("unreachable")  # pragma: no cover
