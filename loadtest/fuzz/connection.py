"""One fuzz connection: send a case's pieces from a given source address, end it as the
case says, and see how the server answers and when it closes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import trio

from .corpus import WS_PROTOCOLS, Case
from .observation import ConnRecord
from .replies import WsReply, http_statuses, mqtt_disconnect, mqtt_reply, ws_reply

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
    sent_after = 0.0
    try:
        await sock.bind((source, 0))
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await sock.connect(("127.0.0.1", port))
        except (OSError, trio.TooSlowError):
            return ConnRecord(case.index, case.end, "", "none", "connect-failed", started=started, finished=time.time())
        peer = peer_name(sock)
        connected = time.monotonic()
        try:
            with trio.move_on_after(SEND_LIMIT) as sending:
                for i, piece in enumerate(case.pieces):
                    if i and case.gap:
                        await trio.sleep(case.gap)
                    if i == 1 and case.await_reply:
                        before = time.monotonic()
                        received = await _read_head(sock, kept, wait)
                        connected += time.monotonic() - before  # the server's time, not ours
                    await _send_all(sock, piece)
            sent_after = time.monotonic() - connected
        except OSError:
            # ECONNRESET or EPIPE: the server closed while we sent, maybe with its
            # answer on its way first: read what came.
            ending = "reset"
            received += (await _read(sock, kept, wait))[1]
        else:
            if sending.cancelled_caught:
                ending = "stuck"  # the server stopped reading us and never closed
            elif case.end == "abort":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
                ending = "aborted"
            else:
                if case.end == "half-close":
                    with contextlib.suppress(OSError):  # reset already: the read says so
                        sock.shutdown(socket.SHUT_WR)
                ending, got = await _read(sock, kept, wait)
                received += got
    finally:
        sock.close()
    data = bytes(kept)
    statuses: tuple[int, ...] = ()
    disconnect = ""
    if protocol in WS_PROTOCOLS:
        record = _ws_record(case, protocol, peer, ending, data, received, started)
        record.sent_after = sent_after
        return record
    if protocol == "mqtt":
        reply = mqtt_reply(data)
        disconnect = mqtt_disconnect(data)
    else:
        statuses = http_statuses(data)
        reply = str(statuses[0]) if statuses else "none"
    return ConnRecord(case.index, case.end, peer, reply, ending, statuses, received, started, time.time(), disconnect)


async def _read(sock: trio.socket.SocketType, kept: bytearray, wait: float) -> tuple[str, int]:
    """Read until the server closes (``eof``), resets (``reset``), sends more than
    :data:`READ_CAP` (``cut``) or ``wait`` passes (``open``); keep the first :data:`KEEP`
    bytes. How it ended, and the bytes read."""
    received = 0
    try:
        with trio.move_on_after(wait):
            while True:
                data = await sock.recv(65536)
                if not data:
                    return "eof", received
                received += len(data)
                kept += data[: KEEP - len(kept)]
                if received >= READ_CAP:
                    return "cut", received
    except OSError:
        return "reset", received
    return "open", received


async def _read_head(sock: trio.socket.SocketType, kept: bytearray, wait: float) -> int:
    """Read the server's answer to the opening handshake into ``kept``, until its head
    is whole, the server closes, or ``wait`` passes; the bytes read."""
    got = 0
    with trio.move_on_after(wait):
        while b"\r\n\r\n" not in kept:
            data = await sock.recv(65536)
            if not data:
                break
            got += len(data)
            kept += data[: KEEP - len(kept)]
    return got


def _ws_record(
    case: Case, protocol: str, peer: str, ending: str, data: bytes, received: int, started: float
) -> ConnRecord:
    """A WebSocket connection's record: its answer, and whether the echo was true."""
    got = ws_reply(data, mqtt=protocol == "mqtt-ws")
    opened = got.outcome.startswith(("close-", "eof", "bad-"))  # a 101 came
    if case.deflate is not None and opened and got.deflate != case.deflate:
        said = (
            "agreed to a permessage-deflate offer RFC 7692 says to decline"
            if got.deflate
            else ("declined a valid permessage-deflate offer")
        )
        # Judged as a fault of the server's, whatever the frames did after.
        got = WsReply("bad-handshake", problem=said)
    reply, disconnect, echo = got.outcome, "", ""
    if protocol == "mqtt-ws" and got.outcome.startswith(("close-", "eof")):
        reply, disconnect = mqtt_reply(got.binary), mqtt_disconnect(got.binary)
    if case.messages is not None and not got.outcome.startswith("bad-"):
        sent = case.messages
        echoed = list(got.messages)
        if echoed != list(sent[: len(echoed)]):
            echo = "wrong"
        else:
            echo = "short" if case.echo_all and len(echoed) < len(sent) else "ok"
    return ConnRecord(
        case.index,
        case.end,
        peer,
        reply,
        ending,
        (),
        received,
        started,
        time.time(),
        disconnect,
        got.outcome,
        case.fault,
        case.expect,
        echo,
        got.problem,
    )
