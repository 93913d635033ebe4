"""One fuzz connection: send a case's pieces from a given source address, end it as the
case says, and see how the server answers and when it closes.
"""

from __future__ import annotations

import socket
import struct
import time

import trio

from .corpus import Case
from .observation import ConnRecord
from .replies import http_statuses, mqtt_disconnect, mqtt_reply

__all__ = ["peer_name", "run_case"]

CONNECT_TIMEOUT = 5.0
"""Seconds a connect may take before the case counts as ``connect-failed``."""
READ_CAP = 256 * 1024
"""Bytes read per connection before we stop reading (a big download): ``cut``."""
SEND_LIMIT = 10.0
"""Seconds a case's pieces may take to send (a trickle takes at most ~1.5 s)."""
KEEP = 64 * 1024
"""Bytes of each connection's replies kept for classifying them."""

_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


def peer_name(sock: socket.socket | trio.socket.SocketType) -> str:
    """Our address as the server sees it (``host:port``), as its presence log gives it."""
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


async def run_case(case: Case, protocol: str, port: int, source: str, wait: float) -> ConnRecord:
    """Send one case on a new connection and see how it ends."""
    started = time.time()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peer = ""
    received = 0
    kept = bytearray()
    ending = "open"
    try:
        await sock.bind((source, 0))
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await sock.connect(("127.0.0.1", port))
        except (OSError, trio.TooSlowError):
            return ConnRecord(case.index, case.end, "", "none", "connect-failed", started=started, finished=time.time())
        peer = peer_name(sock)
        try:
            with trio.move_on_after(SEND_LIMIT) as sending:
                for i, piece in enumerate(case.pieces):
                    if i and case.gap:
                        await trio.sleep(case.gap)
                    await _send_all(sock, piece)
            if sending.cancelled_caught:
                ending = "stuck"  # the server stopped reading us and never closed
            elif case.end == "abort":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
                ending = "aborted"
            else:
                if case.end == "half-close":
                    sock.shutdown(socket.SHUT_WR)
                with trio.move_on_after(wait):
                    while True:
                        data = await sock.recv(65536)
                        if not data:
                            ending = "eof"
                            break
                        received += len(data)
                        if len(kept) < KEEP:
                            kept += data[: KEEP - len(kept)]
                        if received >= READ_CAP:
                            ending = "cut"
                            break
        except OSError:
            ending = "reset"  # ECONNRESET or EPIPE: the server reset the connection
    finally:
        sock.close()
    data = bytes(kept)
    statuses: tuple[int, ...] = ()
    disconnect = ""
    if protocol == "mqtt":
        reply = mqtt_reply(data)
        disconnect = mqtt_disconnect(data)
    else:
        statuses = http_statuses(data)
        reply = str(statuses[0]) if statuses else "none"
    return ConnRecord(case.index, case.end, peer, reply, ending, statuses, received, started, time.time(), disconnect)
