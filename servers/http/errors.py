"""Error answers written past h11, and the lingering close that lets the client read them."""

from __future__ import annotations

import logging

import trio

import idlekeeper

from ..httpdate import http_date

__all__ = ["error_response", "linger", "log_refusal", "send_error"]

logger = logging.getLogger("servers.http")

_REASONS = {
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


def log_refusal(status: int, why: str) -> None:
    """The one INFO line a refused request gets, with no traceback: bad input is the
    client's doing, not a server fault, and a client sending it in bulk must not be
    able to flood the log with stacks. h11's messages quote the offending bytes
    (escaped by repr): cut to keep lines short."""
    logger.info("http: %d for %s", status, why if len(why) <= 200 else why[:200] + "...")


def error_response(status: int) -> bytes:
    """The bytes of an error answer that closes its connection, written past h11 (which
    may already be in an error state): a plain-text body naming the status, and the
    ``Date`` an origin server's every answer carries (RFC 9110 §6.6.1)."""
    reason = _REASONS.get(status, "Error")
    body = f"{status} {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nDate: {http_date().decode()}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


async def send_error(stream: idlekeeper.WatchedStream, status: int, linger_for: float = 1.0) -> None:
    """:func:`error_response` written to ``stream``, then a lingering close of
    ``linger_for`` seconds so that the client reads it rather than a reset."""
    try:
        await stream.send_all(error_response(status))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    await linger(stream, linger_for)


async def linger(conn: idlekeeper.WatchedStream, seconds: float = 1.0, limit: int = 256 * 1024) -> None:
    """Half-close, then read and discard for a moment before closing (nginx's lingering
    close): closing with the client's bytes unread would reset the connection, and the
    reset can destroy the error response before the client reads it."""
    with trio.move_on_after(seconds):
        try:
            # TLS has no half-close (trio's SSLStream cannot send_eof): the response's
            # Content-Length and "Connection: close" tell the client it is complete.
            if isinstance(conn, trio.abc.HalfCloseableStream):
                await conn.send_eof()
            drained = 0
            while drained < limit:
                data = await conn.receive_some(65536)
                if not data:
                    break
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
