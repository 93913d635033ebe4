"""The QoS load test's queued part: what a message queued for an absent persistent session
costs the server in RSS, and whether the session gets every one back, in order, on return."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from servers.heartbeat.mqtt.encoders import encode_puback

from ..mqtt_frames import frames
from ..sampler import cpu_seconds, processes, rss_bytes
from .client import RECV_SIZE, goodbye, open_client, open_when_available, publish_prefix, subscribe
from .load import PAYLOAD_HEADER, QosLoad
from .tally import Tally

__all__ = ["publish_all", "run_queued", "settled_rss", "take_deliveries"]

QUEUE_FILL_WINDOW = 100
"""PUBLISHes the queue filler keeps unacknowledged: the fill is a set-up step, not measured."""


def settled_rss(pids: Sequence[int], pause: float = 0.5) -> int:
    """RSS of ``pids`` once the server had ``pause`` to finish what it was doing;
    the lower of two readings, so a transient allocation is not counted."""
    time.sleep(pause)
    first = rss_bytes(processes(pids))
    time.sleep(0.1)
    return min(first, rss_bytes(processes(pids)))


def publish_all(sock: socket.socket, topic: str, n: int, payload: int, window: int) -> None:
    """Publish ``n`` QoS 1 messages, ``window`` unacknowledged at most; return once all are acknowledged."""
    prefix = publish_prefix(topic, payload)
    padding = bytes(payload - PAYLOAD_HEADER.size)
    buf = bytearray()
    sent = acked = 0
    while acked < n:
        room = min(window - (sent - acked), n - sent)
        if room > 0:
            now_ns = time.monotonic_ns()
            sock.sendall(
                b"".join(
                    prefix + (s % 65535 + 1).to_bytes(2, "big") + PAYLOAD_HEADER.pack(0, s, now_ns) + padding
                    for s in range(sent, sent + room)
                )
            )
            sent += room
        data = sock.recv(RECV_SIZE)
        if not data:
            raise ConnectionError(f"the server closed the publisher after {acked} of {n} acknowledgements")
        buf += data
        packets, used = frames(buf)
        del buf[:used]
        acked += sum(1 for first, _, _ in packets if first == 0x40)


def take_deliveries(buf: bytearray, see: Callable[[int], object]) -> tuple[bytes, int, int]:
    """Take the whole packets at the start of ``buf`` (the rest stays, for the next
    read), calling ``see`` with the sequence number each PUBLISH's payload carries:
    the PUBACKs that acknowledge its QoS 1 PUBLISHes, in one piece, how many PUBLISHes
    were seen, and how many had DUP set. (``see`` is called in the loop, as the drain's
    client did inline: its cost is in the rate the drain is measured at.)"""
    packets, used = frames(buf)
    acks = []
    seen = dups = 0
    for first, start, end in packets:
        if first >> 4 != 3:
            continue
        offset = start + 2 + ((buf[start] << 8) | buf[start + 1])
        if (first >> 1) & 3:
            acks.append(encode_puback(int.from_bytes(buf[offset : offset + 2], "big")))
            offset += 2
        if first & 0x08:
            dups += 1
        if end - offset >= PAYLOAD_HEADER.size:
            see(PAYLOAD_HEADER.unpack_from(buf, offset)[1])
            seen += 1
    del buf[:used]
    return b"".join(acks), seen, dups


def _receive_all(sock: socket.socket, n: int, idle: float) -> dict[str, Any]:
    """Take deliveries (acknowledging each) until ``n`` distinct ones came or ``idle`` seconds pass without one."""
    tally = Tally()
    buf = bytearray()
    received = dup_flag = 0
    sock.settimeout(idle)
    while tally.unique < n:
        try:
            data = sock.recv(RECV_SIZE)
        except TimeoutError:
            break
        if not data:
            break
        buf += data
        acks, seen, dups = take_deliveries(buf, tally.see)
        received += seen
        dup_flag += dups
        if acks:
            sock.sendall(acks)
    return {
        "received": received,
        "unique": tally.unique,
        "duplicates": tally.duplicates,
        "out_of_order": tally.out_of_order,
        "dup_flagged": dup_flag,
    }


def run_queued(port: int, pids: Sequence[int], load: QosLoad, tag: str = "ik") -> dict[str, Any]:
    """The queued part: RSS per message queued for an absent persistent session, and its
    delivery on return (session present, all of them, in order)."""
    client_id = f"{tag}-qos-away"
    first, _ = open_client(port, client_id, clean=False)
    try:
        granted = subscribe(first, "q/#", 1)
    finally:
        goodbye(first)
    # The publisher connects before the baseline, so its own memory is not counted.
    publisher, _ = open_client(port, f"{tag}-qos-filler", timeout=60.0)
    try:
        before = settled_rss(pids)
        t0 = time.monotonic()
        publish_all(publisher, "q/m", load.queued, load.payload, QUEUE_FILL_WINDOW)
        fill_s = time.monotonic() - t0
        after = settled_rss(pids)
        server = processes(pids)
        # A fleet's gateway may answer "unavailable" while it writes the fill's reports to
        # Redis: the client comes back, as a device would, and the drain is timed from the
        # CONNECT that was accepted (the refusals are reported).
        back, present, refused, t0 = open_when_available(port, client_id, clean=False, timeout=60.0)
        cpu0 = cpu_seconds(server)
        try:
            got = _receive_all(back, load.queued, idle=5.0)
            drain_s = time.monotonic() - t0
            # The drain is a ping-pong of windows, so its rate is also the client's and the
            # loopback's; the server's CPU per message is its own part.
            drain_cpu = cpu_seconds(server) - cpu0
        finally:
            goodbye(back)
        drained = settled_rss(pids, pause=0.2)
    finally:
        goodbye(publisher)
    lost = load.queued - got["unique"]
    return {
        "queued": load.queued,
        "payload_bytes": load.payload,
        "granted_qos": granted,
        "rss_before_bytes": before,
        "rss_queued_bytes": after,
        "rss_drained_bytes": drained,
        "bytes_per_queued": (after - before) / load.queued,
        "fill_s": fill_s,
        "session_present": present,
        "connects_refused": refused,
        **got,
        "lost": lost,
        "in_order": got["out_of_order"] == 0 and got["duplicates"] == 0,
        "drain_s": drain_s,
        "drain_msgs_per_s": got["unique"] / drain_s if drain_s > 0 else math.nan,
        "drain_cpu_us_per_msg": drain_cpu / got["unique"] * 1e6 if got["unique"] else math.nan,
        "ok": present and lost == 0 and got["out_of_order"] == 0 and got["duplicates"] == 0,
    }
