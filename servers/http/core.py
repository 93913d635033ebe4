"""What both HTTP drivers share: the configuration, the phases, and the server's
state and graceful shutdown (:class:`HttpServer`).

The drivers are :mod:`.dense` (idlekeeper's dense engine, no task per connection) and
:mod:`.streams` (a task per connection over a watched trio stream, and TLS);
:mod:`.server` starts whichever the configuration asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

import idlekeeper

from ..config import WorkerConfig
from ..prometheus import Families, Metric
from .asgi import ASGIApp
from .lifespan import Lifespan

__all__ = ["BACKGROUND_PER_CONNECTION", "ENGINES", "TIMEOUT_LINGER", "HttpConfig", "HttpServer", "Phase", "address"]

TIMEOUT_LINGER = 0.25
"""Seconds a connection cut for a header or body timeout lingers after its 408:
enough for the bytes in flight to drain, not enough to be worth attacking."""

ENGINES = ("dense", "streams")

BACKGROUND_PER_CONNECTION = 8
"""App calls one connection may leave running after their responses (background
tasks) while it takes its next request; past it, it waits for one to return."""


@dataclass
class HttpConfig(WorkerConfig):
    """Timeouts and limits. The CLI fills it in; ``docs/reference/http.md`` sets the
    defaults beside nginx's, HAProxy's, hypercorn's and uvicorn's."""

    port: int = 8080
    keep_alive_timeout: float = 15.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    max_connection_age: float | None = None
    max_requests: int | None = None
    max_header_size: int = 16 * 1024
    max_body_size: int = 16 * 1024 * 1024
    max_connections: int = 16_000
    grace: float = 10.0
    max_background: int = 1000
    """App calls the worker lets run on after their responses (background tasks) while
    their connections take the next request; past it, a connection waits for its app
    to return, as if the work were part of the response."""
    engine: str = "dense"
    """``dense`` (no task per connection) or ``streams`` (a task each); both serve TLS."""
    websockets: bool = True
    """Serve WebSocket upgrades to the app (``--ws wsproto``); off, they are 404."""
    ws_max_size: int = 16 * 1024 * 1024
    """Bytes of one WebSocket message, after inflation; beyond it, close 1009."""
    ws_ping_interval: float | None = 20.0
    """Seconds between the server's pings (None: no pings, no liveness deadline)."""
    ws_ping_timeout: float | None = 20.0
    """Seconds a pong may take, beyond the interval, before the peer is closed 1011."""
    ws_per_message_deflate: bool = True
    """Take a client's ``permessage-deflate`` offer (RFC 7692), memory bounded."""
    ws_close_timeout: float = 10.0
    """Seconds the peer has to answer this side's close frame before the cut."""
    evict_at_cap: bool = False
    """At ``max_connections``, close the oldest connection to take a new one (one not
    with the app if there is one) rather than refuse the new one with 503, as nginx
    reuses idle keep-alive connections: then a crowd of idle connections cannot lock
    a new client out. For small servers (the status endpoint); off by default."""


class Phase:
    """Where a connection is; a header or body timeout in HEAD or BODY is answered 408."""

    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    APP = "app"
    DONE = "done"


class HttpServer:
    """What both drivers share: the app, the limits, the connections, the counters and
    the graceful shutdown. ``nursery.start(serve_http, ...)`` returns one."""

    def __init__(
        self, app: ASGIApp, config: HttpConfig, keeper: idlekeeper.Keeper, lifespan: Lifespan | None = None
    ) -> None:
        self.app = app
        self.lifespan = lifespan
        """The app's lifespan (its shutdown runs at the end of :meth:`shutdown`), if it has one."""
        self.config = config
        self.keeper = keeper
        self.connections: dict[Any, None] = {}
        """The open connections, oldest first (a dict keeps insertion order)."""
        self.in_flight = 0
        """Requests with the app now."""
        self.closing = False
        self.requests_total = 0
        self.refused_total = 0
        self.evicted_total = 0
        """Connections closed to make room for a new one (``config.evict_at_cap``)."""
        self.unread_cut_total = 0
        """Connections cut because finished responses sat unacknowledged in the kernel
        for the send timeout (dense driver)."""
        self.background = 0
        """App calls running on after their response (background tasks)."""
        self.background_waits = 0
        """Times a connection waited for its app to return, at a bound of background calls."""
        self.port = 0
        """The port it listens on (read it after ``nursery.start``)."""
        self.state: dict[str, Any] | None = lifespan.state if lifespan is not None and lifespan.supported else None
        """The lifespan state (ASGI's lifespan-state extension), copied into each scope."""
        self.scheme = "http" if config.tls is None else "https"
        self._idle_event: trio.Event | None = None

    @property
    def engine(self) -> str:
        """Which driver serves the connections."""
        raise NotImplementedError

    def must_close(self, started: float, requests: int) -> bool:
        """Whether the next response of a connection (begun at ``started``, with
        ``requests`` served) says ``Connection: close``."""
        cfg = self.config
        if self.closing:
            return True
        if cfg.max_requests is not None and requests >= cfg.max_requests:
            return True
        return cfg.max_connection_age is not None and trio.current_time() - started >= cfg.max_connection_age

    def make_room(self, newcomer: object = None) -> bool:
        """At the connection cap: close the oldest connection (other than
        ``newcomer``) not with the app, else the oldest, if ``config.evict_at_cap``;
        whether one was closed. It leaves :attr:`connections` at once."""
        if not self.config.evict_at_cap or self.closing:
            return False
        connections = self.connections
        victim = next((c for c in connections if c is not newcomer and not self._with_app(c)), None)
        if victim is None:
            # Every slot has a request in flight: the oldest gives way, as a client
            # that hangs up would (its app hears http.disconnect).
            victim = next((c for c in connections if c is not newcomer), None)
            if victim is None:
                return False
        del connections[victim]
        self.evicted_total += 1
        self._evict(victim)
        return True

    def exchange_started(self) -> None:
        self.in_flight += 1
        self.requests_total += 1

    def exchange_ended(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._idle_event is not None:
            self._idle_event.set()

    def figures(self) -> list[Metric]:
        """This server's live figures, as Prometheus families (see :mod:`servers.prometheus`)."""
        f = Families({"worker": str(self.config.worker)})
        f.gauge("http_connections", "Open connections.", len(self.connections))
        f.gauge("http_requests_in_flight", "App calls running now (background work included).", self.in_flight)
        f.gauge(
            "http_background_app_calls",
            "App calls running on after their response was complete (background tasks), their connections moved on.",
            self.background,
        )
        f.counter(
            "http_background_waits_total",
            "Responses whose connection waited for the app to return: the connection or the worker held as many"
            " background calls as it may (--max-background).",
            self.background_waits,
        )
        f.counter("http_requests_total", "Requests served.", self.requests_total)
        f.counter("http_refused_total", "Connections refused with 503.", self.refused_total)
        f.counter(
            "http_unread_responses_cut_total",
            "Connections cut when the client acknowledged none of its queued responses for the send timeout.",
            self.unread_cut_total,
        )
        if self.config.evict_at_cap:
            f.counter("http_evicted_total", "Connections closed to make room for a new one.", self.evicted_total)
        return f.families

    async def shutdown(self) -> None:
        """Graceful shutdown: stop accepting, close idle keep-alive connections now,
        let requests in flight finish (their responses say ``Connection: close``)
        for up to ``grace`` seconds, then close whatever is left; then the app's
        lifespan shutdown."""
        self.closing = True
        self._stop_accepting()
        with trio.move_on_after(self.config.grace):
            while True:
                self._close_idle()
                if not self.in_flight and not self._busy():
                    break
                self._idle_event = trio.Event()
                with trio.move_on_after(0.05):  # idle connections too: a request may just have ended
                    await self._idle_event.wait()
        self._idle_event = None
        self._cut_all()
        if self.lifespan is not None:
            await self.lifespan.shutdown()

    # -- what each driver does its own way ---------------------------------------------

    def _stop_accepting(self) -> None:
        raise NotImplementedError

    def _close_idle(self) -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        raise NotImplementedError

    def _cut_all(self) -> None:
        raise NotImplementedError

    def _with_app(self, conn: Any) -> bool:
        """Whether ``conn`` has a request with the app now."""
        raise NotImplementedError

    def _evict(self, conn: Any) -> None:
        """Close ``conn`` now to make room (:meth:`make_room`)."""
        raise NotImplementedError


def address(sock: object, which: str) -> tuple[str, int] | None:
    """``sock.getpeername()`` or ``getsockname()`` (``which``) as ASGI's ``(host, port)``, or None."""
    try:
        address = getattr(sock, which)()
    except (OSError, AttributeError):
        return None
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None
