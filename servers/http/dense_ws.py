"""A WebSocket on the dense driver: the :class:`~.websocket.WsPipe` over an engine
transport, and the switch from a request head to a WebSocket.

Reading stays the engine's callbacks (:meth:`~.dense.HttpProtocol.data_received`
feeds the exchange, and answers pings without waking anything); writing is the
transport's queue. The app's task, a parked runner handed the exchange as a request
would be, is the connection's only task.
"""

from __future__ import annotations

from typing import Protocol

from h11 import Connection as H11Connection

import idlekeeper

from ..ws.upgrade import Offer, denial_head, read_offer
from .asgi import Scope
from .dense_server import DenseHttpServer
from .errors import log_refusal
from .head import RequestHead
from .websocket import WebSocketExchange, after_upgrade, websocket_scope

__all__ = ["DensePipe", "open_websocket"]


class HttpProtocol(Protocol):
    """What is used here of :class:`~.dense.HttpProtocol` (which imports this module)."""

    t: idlekeeper.Transport
    h11: H11Connection | None
    server: DenseHttpServer
    gone: bool

    def parser(self) -> H11Connection: ...

    async def writable(self) -> None: ...

    def refuse(
        self, status: int, why: str, *, log: bool = True, linger: float = 1.0, response: bytes | None = None
    ) -> None: ...


class DensePipe:
    """:class:`~.websocket.WsPipe` over a dense connection's transport."""

    __slots__ = ("conn",)

    def __init__(self, conn: HttpProtocol) -> None:
        self.conn = conn

    @property
    def watch(self) -> idlekeeper.Watch:
        return self.conn.t

    def put(self, data: bytes) -> None:
        if not self.conn.gone:
            self.conn.t.write(data)

    def queued(self) -> int:
        return self.conn.t.get_write_buffer_size()

    async def drain(self) -> None:
        await self.conn.writable()

    def reading(self, on: bool) -> None:
        t = self.conn.t
        if on:
            t.resume_reading()
        else:
            t.pause_reading()

    def finish(self) -> None:
        self.conn.t.close()


def open_websocket(
    conn: HttpProtocol, request: RequestHead, headers: list[tuple[bytes, bytes]], scope: Scope
) -> WebSocketExchange | None:
    """The exchange for ``conn``'s upgrade request, with what followed its head;
    None when it is refused (answered here, and the connection closes)."""
    offer = read_offer(request.method, request.http_version, headers)
    if not isinstance(offer, Offer):
        status, why, extra = offer
        log_refusal(status, why)
        conn.refuse(status, why, log=False, response=denial_head(status, extra, 0))
        return None
    early = after_upgrade(conn.parser())
    conn.h11 = None
    server = conn.server
    return WebSocketExchange(DensePipe(conn), websocket_scope(scope, offer), offer, server.config, server.keeper, early)
