"""The dense engine's passes: one epoll set, each ready socket served once a pass.

A pass takes up to ``max_events`` ready sockets from the set in one system call,
reads each once (or sends what is queued for it), then drains each ready listener
in a batch of accepts (:mod:`.accept`), and tells the protocols of the connections
dropped meanwhile. Write-readiness is asked for only while something is queued:
:meth:`Dispatcher._update` keeps each socket's registration in line with what its
transport wants. When, and how often, passes run is :mod:`.coalesce`'s job; the
public face is :class:`~idlekeeper.Engine`.

This is the path every packet takes: keep it free of calls and look-ups it can do
without.
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Callable
from typing import TypeVar, cast

import trio

from . import arrival as _arrival
from .accept import Listener
from .fdtable import FdTable
from .keeper import Keeper
from .lost import EngineClosedError
from .protocol import Protocol
from .tls_transport import TLSSettings, TLSTransport
from .transport import CANNED, CLOSED, EOF_SENT, GATHERING, NO_READ, PEER_EOF, REG_IN, REG_OUT, Transport
from .wakeup import Wakeup
from .watch import ExpireHook

__all__ = ["Dispatcher"]

logger = logging.getLogger("idlekeeper.engine")

_T = TypeVar("_T")

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_REG = REG_IN | REG_OUT
_LAST_READS = 4
"""Reads of what a reset connection left in the kernel, at most (a bound on a drop's work)."""


class Dispatcher:
    """The connections of one engine on its epoll set, and the passes that serve them.

    The engine's state (its settings and counters are documented here) and what a
    :class:`~idlekeeper.transport.Transport` asks of its engine (``_update``,
    ``_drop``, the water marks); :class:`~idlekeeper.Engine` adds the public methods.
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
        coalesce_canned: float = 0.0,
        canned_rate: float = 0.0,
        direct_wait: bool = True,
    ) -> None:
        if not 0 <= low_water <= high_water:
            raise ValueError("need 0 <= low_water <= high_water")
        for name, value in (("coalesce", coalesce), ("coalesce_canned", coalesce_canned), ("canned_rate", canned_rate)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0")
        self.keeper = keeper
        self._epochs = keeper._epochs
        self.coalesce = coalesce
        """Seconds traffic is gathered between passes while it keeps coming (0: a pass per wake-up)."""
        self.coalesce_canned = coalesce_canned
        """Seconds traffic is gathered after a pass that only answered canned requests
        (0: never); see :func:`~idlekeeper.open_engine`."""
        self.canned_rate = canned_rate
        """Canned requests a second from which those windows follow (0: whatever the rate)."""
        # A gathered packet is read up to a window after it came; stamping it then
        # would move its receive deadline out by as much, so it is stamped with when
        # the kernel received it.
        self.arrivals: _arrival.ArrivalClock | None = (
            _arrival.ArrivalClock(trio.current_time) if coalesce or coalesce_canned else None
        )
        """Turns kernel receive stamps into keeper time (only while coalescing)."""
        # The stamps of the current pass's reads: the arrival clock in a pass that
        # follows a window (or every pass, with ``coalesce``), else None (the pass's epoch).
        self._stamping: _arrival.ArrivalClock | None = None
        # Whether every read of the current pass so far was a canned request answered
        # here: only then may a window follow (coalesce_canned).
        self._only_canned = False
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
        self._urgent_fd = self._urgent.fileno()
        # Reserved up to the urgent set's descriptor, the one member of the main set
        # that is not a connection: every event a pass takes then has a slot.
        self._fds: FdTable[Transport] = FdTable(reserve=self._urgent_fd + 1)
        self._epoll.register(self._urgent_fd, _IN)
        # The sets each socket is registered in: the main one, and the direct wait's
        # (idlekeeper.direct_wait) while there is one.
        self._sets: tuple[select.epoll, ...] = (self._epoll,)
        # Events a direct wait took, for the next pass to serve instead of polling.
        self._direct_polled: list[tuple[int, int]] | None = None
        self._listeners: list[Listener] = []
        self._lost: list[tuple[Transport, BaseException | None]] = []
        # TLS transports resumed with plaintext opened for them while paused: handed
        # over at the end of a pass, as drops are told.
        self._resumed: list[TLSTransport] = []
        # Wakes the engine when a connection is dropped from outside its pass (an
        # expiry in the reaper, a takeover in another task): its protocol must hear.
        self._wakeup = Wakeup()
        self._urgent.register(self._wakeup.fd, _IN)
        self._backlog = False
        self._in_pass = False
        # Events the current pass polled (see Transport.alone_in_pass).
        self._polled = 0
        # Connections written to in this pass, whose writes go out as it ends (see
        # Transport.write).
        self._gathered: list[Transport] = []
        # The connection whose connection_made runs, and the address accept() gave it:
        # a peer that reset before it was read has no other (getpeername fails), and
        # an address kept on every transport would cost each of a million connections.
        self._starting: tuple[Transport, object] | None = None
        self.accepted = 0
        """Connections accepted."""
        self.accept_errors = 0
        """Accepts that failed for lack of descriptors or memory (each pauses accepting)."""
        self.callback_errors = 0
        """Protocol callbacks that raised (each closed its connection)."""
        self.passes = 0
        """Passes of the engine's loop."""
        self.windows = 0
        """Coalescing windows waited out (``coalesce``, ``coalesce_canned``)."""
        self.direct_wait = direct_wait
        """Whether passes may start from a wait of the engine's own while trio's loop has
        nothing else to do (see :mod:`idlekeeper.direct_wait`)."""
        self.direct_passes = 0
        """Passes started that way, without a pass of trio's loop."""
        self.canned = 0
        """Requests the engine answered itself (see :meth:`Engine.add_canned_reply`)."""
        self._canned: dict[bytes, bytes] = {}

    # -- a pass ------------------------------------------------------------------------

    def _as_pass(self, step: Callable[[], _T]) -> _T:
        """Run ``step`` as a pass: the connections it drops are told by the step itself,
        at its end, so a drop need not wake the engine."""
        self._in_pass = True
        self._polled = 0
        try:
            return step()
        finally:
            self._in_pass = False
            if self._gathered:  # only if the step raised: it sends them itself
                self._send_gathered()

    def _pass(self) -> int:
        """Serve what is ready, as :meth:`_as_pass` runs a step; its bookkeeping is inline
        here, a call less on every wake-up's path."""
        self._in_pass = True
        self._polled = 0
        try:
            self.passes += 1
            stamping = self._stamping
            if stamping is not None:
                stamping.calibrate()
            self._only_canned = True
            fds = self._fds.slots
            urgent = self._urgent_fd
            ready: list[Listener] = []
            polled = self._direct_polled
            if polled is None:
                polled = self._epoll.poll(0, self.max_events)
            else:
                self._direct_polled = None
            self._polled = len(polled)
            for fd, events in polled:
                entry = fds[fd]
                if entry is not None:
                    if events & _OUT and entry._wbuf is not None:
                        self._only_canned = False  # a queue draining: not to be paced
                        entry._flush()
                    if events & ~_OUT and not entry._io & NO_READ:
                        self._read(entry)
                elif fd == urgent:
                    # Accepts come after the reads, so that a descriptor freed in this pass
                    # and reused by an accept cannot be handed an event meant for the old socket.
                    ready = self._poll_urgent()
            if self._lost:  # a call less a pass in the common case, where nothing was dropped
                self._deliver_lost()
            # A full batch of events means more may be ready: like a listener's backlog,
            # that is served now, not a coalescing window later (where it would pile up).
            backlog = len(polled) >= self.max_events
            if ready:
                self._only_canned = False  # a new connection's CONNECT is not kept a window
            for listener in ready:
                backlog |= listener.accept()
            self._backlog = backlog
            if self._gathered or self._lost or self._resumed:
                self._end_pass()
            if self._only_canned and stamping is None and self.arrivals is not None:
                # A window may follow: the stamps of what it gathers are trusted back to a
                # measurement taken before any of it came (see idlekeeper.arrival).
                self.arrivals.calibrate()
            return len(polled)
        finally:
            self._in_pass = False
            if self._gathered:  # only if the pass raised: it sends them itself
                self._send_gathered()

    def _urgent_pass(self) -> bool:
        """While gathering: tell drops; True if a listener is ready (the window ends)."""
        ready = self._poll_urgent()
        self._end_pass()
        return bool(ready)

    def _end_pass(self) -> None:
        """Send what the pass gathered, and tell the protocols of the connections
        dropped (whose callbacks may write, and drop, more)."""
        while self._gathered or self._lost or self._resumed:
            self._send_gathered()
            self._release_resumed()
            self._deliver_lost()

    def _send_gathered(self) -> None:
        gathered = self._gathered
        # By index: a send may pause a writer whose callback writes to another
        # connection, which joins the list behind.
        i = 0
        while i < len(gathered):
            t = gathered[i]
            i += 1
            if t._io & GATHERING:
                t._send_gathered()
        gathered.clear()

    def _poll_urgent(self) -> list[Listener]:
        """Drain wake-ups and return the listeners with connections waiting."""
        ready: list[Listener] = []
        wake = self._wakeup.fd
        for fd, _events in self._urgent.poll(0):
            if fd == wake:
                self._wakeup.drain()
            else:
                ready.extend(entry for entry in self._listeners if entry.sock.fileno() == fd)
        return ready

    def _read(self, t: Transport) -> None:
        arrivals = self._stamping
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
        if t._tls:  # records, not the protocol's bytes: the transport opens them
            self._only_canned = False
            cast(TLSTransport, t)._tls_received(data, at)
            return
        t._rx = self._epochs.current if at is None else at
        protocol = t._protocol
        if protocol is None:
            return
        if t._io & CANNED:
            reply = self._canned.get(data)
            if reply is not None:
                self.canned += 1
                if t._wbuf is None and t._tx is not self._epochs.current:
                    t._send_now(reply)  # what write() does with a pass's first write
                else:
                    t.write(reply)  # behind what is queued or gathered
                return
        self._only_canned = False
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
            logger.exception(
                "idlekeeper: protocol %r raised on the connection from %s; closing it", protocol, t._peer()
            )
            self._drop(t, exc)

    # -- connections in and out ------------------------------------------------------

    def _start(
        self,
        sock: socket.SocketType,
        protocol: Protocol,
        idle: float | None,
        receive: float | None,
        send: float | None,
        max_age: float | None,
        on_expire: ExpireHook | None,
        peer: object = None,
        tls: TLSSettings | None = None,
    ) -> Transport:
        keeper = self.keeper
        now = trio.current_time()
        t: Transport
        if tls is None:
            t = Transport(keeper, self, sock, stall_check=keeper._stall_check, on_expire=on_expire)
            t._first_deadlines(idle, receive, send, None, max_age, now)
            t._protocol = protocol
        else:
            # The protocol is made when the handshake completes, and its timeouts start then.
            t = secure = TLSTransport(keeper, self, sock, tls, stall_check=keeper._stall_check, on_expire=on_expire)
            secure._begin(protocol, max_age, now)
        if self.arrivals is not None:
            _arrival.enable(sock)
        fd = sock.fileno()
        self._fds.add(fd, t)
        for ep in self._sets:
            ep.register(fd, _IN)
        t._io |= REG_IN
        t.start()
        if tls is not None:
            return t
        self._starting = (t, peer)
        try:
            protocol.connection_made(t)
        except Exception as exc:
            self.callback_errors += 1
            logger.exception("idlekeeper: connection_made of %r raised on the connection from %s", protocol, t._peer())
            self._drop(t, exc)
        finally:
            self._starting = None
        return t

    def _accepted_peer(self, t: Transport) -> object:
        """The address ``accept`` gave ``t``, while its protocol is being made (None else)."""
        starting = self._starting
        return starting[1] if starting is not None and starting[0] is t else None

    def _update(self, t: Transport) -> None:
        """Bring the socket's epoll registration in line with what the transport wants."""
        io = t._io
        if io & CLOSED:
            return
        # A gathered queue has not met the kernel yet: it is sent as the pass ends.
        want = (0 if io & NO_READ else REG_IN) | (0 if t._wbuf is None or io & GATHERING else REG_OUT)
        have = io & _REG
        if want == have:
            return
        fd = t._socket.fileno()
        mask = _mask(want)
        # Nothing wanted means out of the set: a hung-up socket would otherwise be
        # reported on every pass (epoll always reports hang-ups).
        for ep in self._sets:
            if not want:
                ep.unregister(fd)
            elif not have:
                ep.register(fd, mask)
            else:
                ep.modify(fd, mask)
        t._io = (io & ~_REG) | want

    def _mirror_into(self, ep: select.epoll | None) -> None:
        """Register every socket of the main set (and the urgent set) in ``ep`` too, and
        from now on each change; None stops it."""
        if ep is None:
            self._sets = (self._epoll,)
            return
        self._sets = (self._epoll, ep)
        ep.register(self._urgent_fd, _IN)
        for t in self._fds.values():
            mask = _mask(t._io)
            if mask and not t._io & CLOSED:
                ep.register(t._socket.fileno(), mask)

    def _drop(self, t: Transport, exc: BaseException | None) -> None:
        """Close a connection now; its protocol hears of it on the engine's next pass.

        Synchronous and O(1), so that the reaper can call it (through an expiry).
        What the pass wrote to it is offered to the kernel first: without gathering,
        those writes would have been sent before whatever ended the connection.
        """
        if t._io & GATHERING:
            t._send_gathered(closing=True)
        io = t._io
        if io & CLOSED:
            return
        t._io = (io | CLOSED) & ~_REG
        if isinstance(exc, OSError) and not io & PEER_EOF and not t._tls:
            self._read_what_is_left(t)
        sock = t._socket
        fd = sock.fileno()
        if io & _REG:
            for ep in self._sets:
                ep.unregister(fd)
        self._fds.remove(fd, t)
        sock.close()
        t._wbuf = None
        t._sending = False
        t.stop()
        self._lost.append((t, exc))
        self._wake()

    def _read_what_is_left(self, t: Transport) -> None:
        """A send failed: the peer reset the connection (it closed with our bytes unread,
        as a client that sends its last packets and closes does). What it sent before
        the reset is still in the kernel's queue; the protocol is handed it before it
        hears of the end, as it would have been had the read come first (an MQTT
        client's last PUBACKs and its DISCONNECT, which a dropped read would have lost).
        The connection is closed already: what the protocol writes now is dropped."""
        protocol = t._protocol
        if protocol is None:
            return
        for _ in range(_LAST_READS):
            try:
                data = t._socket.recv(self.read_size)
            except OSError:
                return
            if not data:
                return
            try:
                protocol.data_received(data)
            except Exception:
                self.callback_errors += 1
                logger.exception(
                    "idlekeeper: protocol %r raised on the connection from %s; closing it", protocol, t._peer()
                )
                return

    def _resume_later(self, t: Transport) -> None:
        """``t`` resumed reading with plaintext waiting for it: hand it over at the end of
        this pass, or of the next one (woken for it) if this is outside a pass."""
        self._resumed.append(cast(TLSTransport, t))
        self._wake()

    def _wake(self) -> None:
        """Make sure a pass comes soon, to tell what happened outside one."""
        if not self._in_pass:
            self._wakeup.wake()

    def _release_resumed(self) -> None:
        while self._resumed:
            batch, self._resumed = self._resumed, []
            for t in batch:
                t._release_held()

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
        """Close every connection (its protocol told :class:`EngineClosedError`) and the sets."""
        for t in self._fds.values():
            self._drop(t, EngineClosedError())
        self._deliver_lost()
        self._epoll.close()
        self._urgent.close()
        self._wakeup.close()


def _mask(io: int) -> int:
    """The epoll events a transport's registration flags (``REG_IN``, ``REG_OUT``) ask for."""
    return (_IN if io & REG_IN else 0) | (_OUT if io & REG_OUT else 0)
