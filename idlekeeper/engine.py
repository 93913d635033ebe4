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

This module is the engine's public face; a pass over the epoll set is
:mod:`.dispatch`'s, accepting :mod:`.accept`'s, and when passes run :mod:`.coalesce`'s.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import NoReturn

import trio

from . import _linux_only  # noqa: F401  (a clear ImportError off Linux, before anything else)
from ._constructors import NoPublicConstructor
from .accept import Listener, ProtocolFactory
from .coalesce import run_passes
from .dispatch import Dispatcher
from .keeper import Keeper
from .protocol import Protocol
from .tls import DEFAULT_HANDSHAKE_TIMEOUT
from .tls_transport import TLSSettings
from .transport import Transport
from .watch import ExpireHook

__all__ = ["Engine", "open_engine", "serve_protocol"]


class Engine(Dispatcher, metaclass=NoPublicConstructor):
    """One epoll set and one trio task serving many connections; see the module.

    Create it with :func:`open_engine`; hand it listeners with :meth:`serve`.
    All methods are synchronous.
    """

    _OPENER = "idlekeeper.open_engine()"

    # A class default, as the constructor is the Dispatcher's. Set first thing on close:
    # serve and adopt refuse from then on, even from a connection_lost the close tells.
    _closed = False

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
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> list[socket.socket]:
        """Accept connections on ``listeners``, each served by a ``factory()`` protocol.

        The deadlines are where every connection starts (as with
        :func:`~idlekeeper.serve_listeners`); the protocol changes them on its
        transport. A trio listener's socket is taken over by the engine. Returns
        the listening sockets.

        With ``ssl_context`` (server side), each connection speaks TLS: the handshake
        first, within ``handshake_timeout`` seconds of accept, then the protocol,
        which reads and writes plaintext, and whose idle, receive and send timeouts
        start when the handshake completes (see :mod:`idlekeeper.tls_transport`).
        """
        if self._closed:
            raise trio.ClosedResourceError("this engine is closed")
        tls = None
        if ssl_context is not None:
            tls = TLSSettings(ssl_context, handshake_timeout, idle, receive, send, self.keeper.stats)
            idle = receive = send = None  # they start at the end of the handshake
        out = []
        for listener in listeners:
            if isinstance(listener, socket.socket):
                sock = listener
            else:
                # Wake any task blocked in its accept() (ClosedResourceError) before the
                # descriptor changes hands: trio must not keep it registered.
                trio.lowlevel.notify_closing(listener.socket)
                sock = socket.socket(fileno=listener.socket.detach())
            sock.setblocking(False)
            entry = Listener(self, sock, factory, idle, receive, send, max_age, on_expire, tls)
            self._listeners.append(entry)
            self._urgent.register(sock.fileno(), select.EPOLLIN)
            out.append(sock)
        return out

    def add_canned_reply(self, request: bytes, reply: bytes) -> None:
        """Answer ``request`` with ``reply`` in the engine, on connections whose protocol
        allows it (:attr:`Transport.canned_replies <idlekeeper.Transport.canned_replies>`).

        For the request a protocol gets most and always answers the same way: a
        keep-alive probe (MQTT's PINGREQ, ``c0 00``, answered ``d0 00``). A read of
        exactly those bytes is then answered without a call into the protocol, which
        is most of what such a request costs. :attr:`canned` counts the answers.
        """
        if not request:
            raise ValueError("a canned request must not be empty (an empty read is the peer's EOF)")
        self._canned[bytes(request)] = bytes(reply)

    def close_listeners(self) -> None:
        """Stop accepting; connections already accepted go on."""
        for entry in self._listeners:
            entry.close()
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
        return iter(self._fds.values())

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
            raise trio.ClosedResourceError("this engine is closed")
        sock.setblocking(False)
        return self._start(sock, protocol, idle, receive, send, max_age, on_expire)

    def _close(self) -> None:
        self._closed = True
        self.close_listeners()
        super()._close()


READ_SIZE = 64 * 1024
MAX_EVENTS = 1024
ACCEPT_BATCH = 256
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


@asynccontextmanager
async def open_engine(
    keeper: Keeper,
    *,
    read_size: int = READ_SIZE,
    max_events: int = MAX_EVENTS,
    accept_batch: int = ACCEPT_BATCH,
    high_water: int = HIGH_WATER,
    low_water: int = LOW_WATER,
    coalesce: float = 0.0,
    coalesce_canned: float = 0.0,
    canned_rate: float = 0.0,
    direct_wait: bool = True,
) -> AsyncIterator[Engine]:
    """Start a dense engine (one task) whose connections ``keeper`` watches.

    When the block exits, listeners close and every connection is closed, its
    protocol told :class:`~idlekeeper.EngineClosedError`. ``read_size`` is the
    most one read takes; ``max_events`` the most ready sockets one pass handles;
    ``accept_batch`` the most connections one pass accepts per listener.
    ``coalesce`` (seconds, default 0) trades latency for CPU: while packets keep
    arriving, the engine serves them in one pass every ``coalesce`` seconds instead
    of one wake-up of trio's loop each; every reply waits up to that long. Receive
    deadlines do not move with it: each read is stamped with when the kernel received
    its bytes (:mod:`idlekeeper.arrival`), so a silent peer is found as soon as
    without coalescing.

    ``coalesce_canned`` (seconds, default 0) is the same for the requests the engine
    answers itself (:meth:`Engine.add_canned_reply`: keep-alive probes) and no
    other traffic: a window follows only a pass in which every read was such a
    request, and the first pass that serves anything else ends the run of windows.
    A fleet whose traffic is mostly heartbeats then costs a wake-up a window, not one
    a heartbeat; what else arrives during a window waits for its end (up to
    ``coalesce_canned``), and a flow of other traffic is served as without it.
    ``coalesce``, where set, applies to every pass instead. With ``canned_rate`` (a
    second, default 0: whatever the rate) the windows follow only while canned
    requests come at least that fast (:class:`~idlekeeper.coalesce.CannedPace`): a
    probe that comes alone is answered at once, and only a fleet's stream of them is
    gathered. ``1 / coalesce_canned`` is the natural choice: a window then gathers
    more than one on average, or none follows.

    ``direct_wait`` (default on): while no other task is runnable and no deadline is
    due, the engine waits for its sockets on an epoll set of its own that also holds
    trio's, and runs the next pass without a pass of trio's loop; anything else
    (another task's socket, a timer, a signal) gives the loop back at once. Spread-out
    traffic (heartbeats) then costs a plain ``epoll_wait`` a wake-up instead of trio's
    loop; see :mod:`idlekeeper.direct_wait`. It turns itself off under a clock other
    than the system's (``MockClock``) and in guest mode.
    """
    engine = Engine._create(
        keeper,
        read_size=read_size,
        max_events=max_events,
        accept_batch=accept_batch,
        high_water=high_water,
        low_water=low_water,
        coalesce=coalesce,
        coalesce_canned=coalesce_canned,
        canned_rate=canned_rate,
        direct_wait=direct_wait,
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_passes, engine)
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
    ssl_context: ssl.SSLContext | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    read_size: int = READ_SIZE,
    max_events: int = MAX_EVENTS,
    accept_batch: int = ACCEPT_BATCH,
    high_water: int = HIGH_WATER,
    low_water: int = LOW_WATER,
    coalesce: float = 0.0,
    coalesce_canned: float = 0.0,
    canned_rate: float = 0.0,
    direct_wait: bool = True,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve TCP on ``port`` with a dense engine, one ``factory()`` protocol per connection.

    The dense counterpart of :func:`~idlekeeper.serve_tcp`; compatible with
    ``nursery.start``, which returns the :class:`Engine` (port 0 picks a free port:
    ``engine.listeners[0].getsockname()[1]``). ``ssl_context`` and
    ``handshake_timeout`` are :meth:`Engine.serve`'s; ``read_size`` to ``canned_rate``
    :func:`open_engine`'s, as is ``direct_wait``.
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    try:
        opening = open_engine(
            keeper,
            read_size=read_size,
            max_events=max_events,
            accept_batch=accept_batch,
            high_water=high_water,
            low_water=low_water,
            coalesce=coalesce,
            coalesce_canned=coalesce_canned,
            canned_rate=canned_rate,
            direct_wait=direct_wait,
        )
        async with opening as engine:
            engine.serve(
                listeners,
                factory,
                idle=idle,
                receive=receive,
                send=send,
                max_age=max_age,
                on_expire=on_expire,
                ssl_context=ssl_context,
                handshake_timeout=handshake_timeout,
            )
            task_status.started(engine)
            await trio.sleep_forever()
    finally:
        # Those the engine did not take over (a start cancelled or failed) close here.
        for listener in listeners:
            if listener.socket.fileno() != -1:
                listener.socket.close()
    raise AssertionError("unreachable")  # pragma: no cover
