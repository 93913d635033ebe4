"""TLS on the keeper's terms: the handshake is a phase with a deadline of its own.

``serve_listeners(..., ssl_context=ctx)`` (and ``serve_tcp``) wrap each accepted
socket stream in a :class:`trio.SSLStream` and watch *that*. The handler reads and
writes plaintext through the same :class:`~idlekeeper.WatchedStream` as over plain
TCP, so activity means application data, and every deadline a handler declares works
unchanged. The socket under the TLS layer is found through ``transport_stream``: it is
the one the keeper checks for unread bytes before an inactivity expiry (stall safety
sees kernel bytes, TLS records included) and the one it closes.

The handshake comes first, under an absolute deadline ``handshake_timeout`` seconds
from accept: a client that stalls mid-handshake, or trickles its ClientHello a byte
at a time, is cut there (a keeper expiry with reason ``absolute``, at most one tick
late), and a client that sends something other than a TLS handshake is cut as soon
as that is known. Either is logged on one line with its reason and counted in
:attr:`KeeperStats.handshake_failures <idlekeeper.KeeperStats.handshake_failures>`.
No idle, receive or send timeout runs during the handshake; they start when it
completes (counting from then), and the absolute deadline goes back to ``max_age``'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .keeper import Keeper
from .stats import HandshakeFailure
from .tls_transport import handshake_failure, peer_address
from .transport import Transport
from .watch import ExpireHook, WatchedStream, find_socket

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "peer_certificate", "peer_common_name"]

logger = logging.getLogger("idlekeeper.tls")

DEFAULT_HANDSHAKE_TIMEOUT = 10.0
"""Seconds from accept a TLS client has to complete its handshake (nginx's
``ssl_handshake_timeout`` is 60 s, HAProxy's ``timeout client``; 10 s is a few
round trips across the world with room to spare, and little for an attacker)."""

# A clean close (close_notify) after the handler returns is a courtesy: it must not
# hold a connection whose peer stopped reading.
CLOSE_TIMEOUT = 1.0


def _tls_end(stream: object) -> trio.SSLStream[Any] | ssl.SSLObject | None:
    """The TLS end of a connection: the SSLStream in a chain of ``transport_stream``
    wrappers, or a dense engine's TLS transport's SSLObject; None if there is none."""
    current: object = stream
    for _ in range(16):
        if isinstance(current, trio.SSLStream):
            return current
        obj = getattr(current, "ssl_object", None)
        if isinstance(obj, ssl.SSLObject):
            return obj
        current = getattr(current, "transport_stream", None)
        if current is None:
            return None
    return None


def peer_certificate(stream: trio.abc.Stream | Transport) -> dict[str, Any] | None:
    """The verified certificate the TLS peer presented, as :meth:`ssl.SSLSocket.getpeercert`
    decodes it; None if ``stream`` (a stream, or a dense engine's transport) is not TLS,
    the handshake has not completed, or the peer presented none (a context with
    ``verify_mode`` ``CERT_NONE`` never asks)."""
    tls = _tls_end(stream)
    if tls is None:
        return None
    try:
        cert = tls.getpeercert()
    except (ValueError, trio.NeedHandshakeError):
        return None
    return cert or None


def peer_common_name(stream: trio.abc.Stream | Transport) -> str | None:
    """The common name (CN) in the subject of the peer's verified certificate, or None.

    The identity Mosquitto's ``use_identity_as_username`` takes: with several CNs, the
    first (a certificate ``CN=bob, CN=alice`` is bob, as Mosquitto reads it).
    """
    cert = peer_certificate(stream)
    if cert is None:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


async def serve_tls(
    raw: trio.abc.Stream,
    handler: Callable[[WatchedStream], Awaitable[object]],
    *,
    keeper: Keeper,
    ssl_context: ssl.SSLContext,
    https_compatible: bool,
    handshake_timeout: float,
    idle: float | None,
    receive: float | None,
    send: float | None,
    max_age: float | None,
    close: bool,
    on_expire: ExpireHook | None,
) -> None:
    """One accepted connection: the TLS handshake under its own deadline, then ``handler``.

    Used by :func:`~idlekeeper.serve_listeners` (which has checked ``handshake_timeout``
    with :func:`~idlekeeper.tls_transport.check_handshake_timeout`); see the module's docs. The caller
    closes ``raw`` afterwards (as :func:`trio.serve_listeners` does); a handshake
    that failed or timed out leaves nothing else to close.
    """
    tls = trio.SSLStream(raw, ssl_context, server_side=True, https_compatible=https_compatible)
    stats = keeper.stats
    # Read now: once the keeper has closed the socket, the address is gone.
    peer = peer_address(find_socket(raw))
    handshook = False
    conn = keeper.watch(tls, max_age=max_age, close=close, on_expire=on_expire).stream
    try:
        with conn:
            after = conn.deadline
            conn.deadline = min(after, trio.current_time() + handshake_timeout)
            try:
                await tls.do_handshake()
                handshook = True
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # Unless the keeper closed the socket under it: that is the timeout, below.
                if not conn.expired:
                    failure, why = handshake_failure(exc)
                    stats.handshake_failures[failure] += 1
                    logger.info("idlekeeper: TLS handshake with %s failed (%s): %s", peer, failure, why)
            if handshook:
                stats.handshakes += 1
                conn.deadline = None if after == math.inf else after
                # Set now, so that each counts from the end of the handshake.
                if idle is not None:
                    conn.idle_timeout = idle
                if receive is not None:
                    conn.receive_timeout = receive
                if send is not None:
                    conn.send_timeout = send
                await handler(conn)
                if not conn.expired:
                    with trio.move_on_after(CLOSE_TIMEOUT):
                        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                            await conn.aclose()
    finally:
        # In a finally: a shutdown that cancels this task as the deadline passes must
        # not lose the count (the Cancelled is then the outer scope's, not the watch's).
        if conn.expired and not handshook:
            stats.handshake_failures[HandshakeFailure.TIMEOUT] += 1
            logger.info(
                "idlekeeper: TLS handshake with %s failed (%s): not complete %ss after accept",
                peer,
                HandshakeFailure.TIMEOUT,
                handshake_timeout,
            )
