"""The QoS load test's blocking MQTT client: connect, subscribe and say goodbye, and the
bytes every QoS 1 PUBLISH of a run starts with."""

from __future__ import annotations

import contextlib
import socket
import time

from servers.heartbeat.mqtt.encoders import encode_connect, encode_disconnect, encode_publish, encode_subscribe

__all__ = [
    "KEEP_ALIVE",
    "RECV_SIZE",
    "Unavailable",
    "goodbye",
    "open_client",
    "open_when_available",
    "publish_prefix",
    "subscribe",
]

KEEP_ALIVE = 600
"""Long enough that no client needs to ping during a run."""
RECV_SIZE = 256 * 1024
"""Bytes asked of one ``recv``: room for many packets, so one read serves a burst."""


def publish_prefix(topic: str, payload_size: int) -> bytes:
    """The bytes before the packet id of every QoS 1 PUBLISH of ``payload_size`` bytes to
    ``topic``: cut from :func:`encode_publish`, so a message costs two concatenations."""
    whole = encode_publish(topic, bytes(payload_size), qos=1, packet_id=1)
    return whole[: len(whole) - payload_size - 2]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed by the server after {len(data)} of {n} bytes")
        data += chunk
    return data


def open_client(port: int, client_id: str, clean: bool = True, timeout: float = 10.0) -> tuple[socket.socket, bool]:
    """A connected, accepted MQTT client (blocking, with ``timeout``) and CONNACK's session-present flag."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    # Acknowledgements go out in small writes; Nagle would hold them for the server's ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.sendall(encode_connect(client_id, keep_alive=KEEP_ALIVE, clean_session=clean))
        connack = _recv_exact(sock, 4)
    except BaseException:
        sock.close()
        raise
    if connack[0] != 0x20 or connack[3] != 0:
        sock.close()
        if connack[0] == 0x20 and connack[3] == UNAVAILABLE:
            raise Unavailable(f"CONNACK refused {client_id!r}: {connack.hex()} (server unavailable)")
        raise RuntimeError(f"CONNACK refused {client_id!r}: {connack.hex()}")
    return sock, bool(connack[2] & 1)


class Unavailable(RuntimeError):
    """CONNACK return code 3, "server unavailable": the CONNECT may be tried again (a
    fleet's gateway refuses so while its lookup of the session waits behind the reports
    it still has to write to Redis)."""


UNAVAILABLE = 3


def open_when_available(
    port: int, client_id: str, clean: bool = True, timeout: float = 10.0, patience: float = 60.0
) -> tuple[socket.socket, bool, int, float]:
    """:func:`open_client`, tried again every 0.2 s while the server answers "unavailable"
    (as a device reconnects), for up to ``patience`` seconds; also how many times it was
    refused, and when (``time.monotonic``) the attempt that was accepted began."""
    refused = 0
    give_up = time.monotonic() + patience
    while True:
        began = time.monotonic()
        try:
            sock, present = open_client(port, client_id, clean, timeout)
        except Unavailable:
            refused += 1
            if began >= give_up:
                raise
            time.sleep(0.2)
            continue
        return sock, present, refused, began


def subscribe(sock: socket.socket, topic_filter: str, qos: int) -> int:
    """SUBSCRIBE to one filter and return the granted QoS (raises on failure)."""
    sock.sendall(encode_subscribe(1, [(topic_filter, qos)]))
    suback = _recv_exact(sock, 5)
    if suback[:4] != b"\x90\x03\x00\x01" or suback[4] > 2:
        raise RuntimeError(f"SUBSCRIBE {topic_filter!r} refused: {suback.hex()}")
    return suback[4]


def goodbye(sock: socket.socket) -> None:
    """DISCONNECT (a persistent session then waits) and close."""
    with contextlib.suppress(OSError):
        sock.sendall(encode_disconnect())
    sock.close()
