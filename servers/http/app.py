"""The application interface of the HTTP server: a request in, a response out.

``async def app(request: Request) -> Response``. The request body is read on
demand (``await request.body()`` or ``async for chunk in request.stream()``), so
an upload is never buffered unless the app asks; the response body is bytes or an
async iterable of bytes, so a large download is streamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["App", "BodyTooLarge", "Request", "Response"]


class BodyTooLarge(Exception):
    """The request body exceeded the server's limit (answered 413)."""


@dataclass
class Request:
    """One HTTP request."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    http_version: str
    _chunks: Callable[[], AsyncIterator[bytes]] = field(repr=False)

    @property
    def path(self) -> str:
        """The target without its query string."""
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        """The query string, without '?'."""
        return self.target.partition("?")[2]

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first header of this name (case-insensitive)."""
        lname = name.lower()
        for key, value in self.headers:
            if key == lname:
                return value
        return default

    def stream(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk, as it arrives."""
        return self._chunks()

    async def body(self) -> bytes:
        """The whole body (bounded by the server's body-size limit)."""
        parts = [chunk async for chunk in self._chunks()]
        return b"".join(parts)


@dataclass
class Response:
    """One HTTP response."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | AsyncIterable[bytes] = b""


App = Callable[[Request], Awaitable[Response]]
"""``async def app(request) -> Response``."""
