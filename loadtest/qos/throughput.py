"""The QoS load test's throughput part: publishers and one acknowledging subscriber on one
``epoll``, messages counted exactly once and in order, their latency, and the CPU of the
client, the server and the machine over the measured window."""

from __future__ import annotations

import array
import gc
import math
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import psutil

from ..mqtt_frames import frames
from ..sampler import cpu_seconds
from ..stats import summary_ms
from .client import RECV_SIZE, goodbye, open_client, publish_prefix, subscribe
from .load import PAYLOAD_HEADER, QosLoad
from .tally import Tally

__all__ = ["CLIENT_SATURATED_PCT", "run_throughput"]

CLIENT_SATURATED_PCT = 90.0
"""Client CPU (% of one core) from which the client, not the server, sets the rate."""


class _Mark(NamedTuple):
    """Counters at an edge of the measured window."""

    at: float
    received: int
    latencies: int
    client_cpu: float
    """CPU seconds of this process."""
    server_cpu: float
    """CPU seconds of the server's processes."""
    machine_busy: float
    """CPU seconds the whole machine was busy, every core (loopback TCP's softirq work included)."""


def _busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class _Conn:
    """A non-blocking socket on the loop, with what is left to write to it."""

    __slots__ = ("fd", "inbuf", "outbuf", "poll", "sock")

    def __init__(self, sock: socket.socket, poll: select.epoll) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.poll = poll
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        poll.register(self.fd, select.EPOLLIN)

    def write(self, data: bytes) -> None:
        """Send now what the kernel takes; keep the rest for EPOLLOUT, in order."""
        if self.outbuf:
            self.outbuf += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.outbuf += data[sent:]
            self.poll.modify(self.fd, select.EPOLLIN | select.EPOLLOUT)

    def flush(self) -> None:
        """EPOLLOUT: send what waits."""
        try:
            sent = self.sock.send(self.outbuf)
        except BlockingIOError:
            return
        del self.outbuf[:sent]
        if not self.outbuf:
            self.poll.modify(self.fd, select.EPOLLIN)

    def read(self) -> bool:
        """Append what arrived; False once the server closed the connection."""
        data = self.sock.recv(RECV_SIZE)
        if not data:
            return False
        self.inbuf += data
        return True


def run_throughput(
    port: int, pids: Sequence[int], load: QosLoad, tag: str = "ik", show: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The throughput part against the server on ``port`` (``pids``: its processes)."""
    opened: list[socket.socket] = []
    try:
        subscriber, _ = open_client(port, f"{tag}-qos-sub")
        opened.append(subscriber)
        granted = subscribe(subscriber, "bench/#", 1)
        if granted != 1:
            raise RuntimeError(f"bench/# granted QoS {granted}, not 1")
        for i in range(load.publishers):
            opened.append(open_client(port, f"{tag}-qos-pub-{i}")[0])
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    publishers = opened[1:]
    poll = select.epoll()
    sub = _Conn(subscriber, poll)
    pubs = [_Conn(s, poll) for s in publishers]
    by_fd = {c.fd: c for c in (sub, *pubs)}
    pub_index = {c.fd: i for i, c in enumerate(pubs)}

    prefixes = [publish_prefix(f"bench/{i}", load.payload) for i in range(load.publishers)]
    padding = bytes(load.payload - PAYLOAD_HEADER.size)
    pack = PAYLOAD_HEADER.pack
    unpack_from = PAYLOAD_HEADER.unpack_from
    sent = [0] * load.publishers
    unacked = [0] * load.publishers
    tallies = [Tally() for _ in range(load.publishers)]
    latencies = array.array("d")
    state = {"sent": 0, "received": 0, "acked": 0, "dup_flag": 0, "foreign": 0}
    errors: list[str] = []
    server = [psutil.Process(pid) for pid in pids]
    monotonic_ns = time.monotonic_ns

    publishing = True
    rotate = 0
    cap = load.cap

    def pump(i: int) -> None:
        # Three bounds: the publisher's own window, the cap on undelivered messages
        # (so no broker queue overflows), and the count.
        room = min(load.window - unacked[i], cap - (state["sent"] - state["received"]))
        if load.count:
            room = min(room, load.count - state["sent"])
        # Refilled on every PUBACK, as client libraries do: holding back for a batch
        # would leave Mosquitto's next PUBACK to Nagle's algorithm (it does not set
        # TCP_NODELAY by default) and our delayed ACK, 40 ms at a time.
        if room <= 0:
            return
        prefix = prefixes[i]
        now_ns = monotonic_ns()
        seq = sent[i]
        parts = []
        for s in range(seq, seq + room):
            parts.append(prefix + (s % 65535 + 1).to_bytes(2, "big") + pack(i, s, now_ns) + padding)
        sent[i] = seq + room
        unacked[i] += room
        state["sent"] += room
        pubs[i].write(b"".join(parts))

    def on_subscriber() -> None:
        buf = sub.inbuf
        packets, used = frames(buf)
        now_ns = monotonic_ns()
        acks = []
        received = 0
        for first, start, end in packets:
            if first >> 4 != 3:
                continue  # PINGRESP and the like: nothing to count
            qos = (first >> 1) & 3
            offset = start + 2 + ((buf[start] << 8) | buf[start + 1])
            if qos:
                acks.append(b"\x40\x02" + buf[offset : offset + 2])
                offset += 2
            if first & 0x08:
                state["dup_flag"] += 1
            if end - offset < PAYLOAD_HEADER.size:
                state["foreign"] += 1
                continue
            index, seq, sent_ns = unpack_from(buf, offset)
            if index >= len(tallies):
                state["foreign"] += 1
                continue
            tallies[index].see(seq)
            latencies.append((now_ns - sent_ns) / 1e9)
            received += 1
        del buf[:used]
        state["received"] += received
        if acks:
            sub.write(b"".join(acks))

    def on_publisher(i: int) -> None:
        conn = pubs[i]
        packets, used = frames(conn.inbuf)
        del conn.inbuf[:used]
        acked = sum(1 for first, _, _ in packets if first == 0x40)
        unacked[i] -= acked
        state["acked"] += acked
        if unacked[i] < 0:
            errors.append(f"publisher {i}: more PUBACKs than PUBLISHes")
            unacked[i] = 0

    # The collector would stop the loop now and then for objects that all die young.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    started = time.monotonic()
    # At most half the run, so a short run still has a window to count.
    warm_at = started + min(load.warmup, load.duration / 2)
    stop_at = started + load.duration

    def mark(now: float) -> _Mark:
        client, server_cpu = time.process_time(), cpu_seconds(server)
        return _Mark(now, state["received"], len(latencies), client, server_cpu, _busy_seconds())

    first_mark = mark(started)
    warm_mark = first_mark
    end_mark = first_mark
    warmed = False
    last_progress = started
    last_received = 0
    last_show = started
    try:
        for i in range(load.publishers):
            pump(i)
        while True:
            now = time.monotonic()
            if not warmed and now >= warm_at and publishing:
                warm_mark = mark(now)
                warmed = True
            if publishing and (now >= stop_at or (load.count and state["sent"] >= load.count)):
                publishing = False
                end_mark = mark(now)
            if errors:
                break
            if not publishing:
                done = state["received"] >= state["sent"] and not any(unacked)
                # Bounded: three idle seconds, or thirty in all, after publishing stopped.
                if done or now - last_progress > 3.0 or now - end_mark.at > 30.0:
                    break
            if state["received"] != last_received:
                last_received = state["received"]
                last_progress = now
            if show is not None and now - last_show >= 0.5:
                last_show = now
                show(f"   {now - started:5.1f} s  {state['received']:,} delivered of {state['sent']:,} published")
            for fd, events in poll.poll(0.05):
                conn = by_fd[fd]
                if events & select.EPOLLOUT:
                    conn.flush()
                if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    if not conn.read():
                        errors.append("the server closed the " + ("subscriber" if conn is sub else "publisher"))
                        poll.unregister(fd)
                        continue
                    if conn is sub:
                        on_subscriber()
                        if publishing:
                            # Deliveries free room under the cap: share it in turn.
                            for k in range(load.publishers):
                                pump((rotate + k) % load.publishers)
                            rotate = (rotate + 1) % load.publishers
                    else:
                        i = pub_index[fd]
                        on_publisher(i)
                        if publishing:
                            pump(i)
    finally:
        if gc_was_enabled:
            gc.enable()
        poll.close()
        for c in (sub, *pubs):
            c.sock.setblocking(True)
            goodbye(c.sock)

    if end_mark is first_mark:  # stopped by an error while publishing
        end_mark = mark(time.monotonic())
    if not warmed:
        warm_mark = first_mark  # a run shorter than the warm-up: count all of it
    window = end_mark.at - warm_mark.at
    measured = end_mark.received - warm_mark.received
    nan = math.nan
    client_cpu = 100 * (end_mark.client_cpu - warm_mark.client_cpu) / window if window > 0 else nan
    server_cpu = 100 * (end_mark.server_cpu - warm_mark.server_cpu) / window if window > 0 else nan
    cores = psutil.cpu_count() or 1
    machine_cpu = 100 * (end_mark.machine_busy - warm_mark.machine_busy) / (window * cores) if window > 0 else nan
    unique = sum(t.unique for t in tallies)
    duplicates = sum(t.duplicates for t in tallies)
    lost = state["sent"] - unique
    return {
        "publishers": load.publishers,
        "payload_bytes": load.payload,
        "window": load.window,
        "outstanding": load.cap,
        "warmup_s": warm_mark.at - started,
        "window_s": window,
        "published": state["sent"],
        "publish_acked": state["acked"],
        "received": state["received"],
        "unique": unique,
        "lost": lost,
        "duplicates": duplicates,
        "out_of_order": sum(t.out_of_order for t in tallies),
        "dup_flagged": state["dup_flag"],
        "foreign": state["foreign"],
        "exactly_once": lost == 0 and duplicates == 0 and not errors,
        "msgs_per_s": measured / window if window > 0 else math.nan,
        "latency_ms": summary_ms(latencies[warm_mark.latencies : end_mark.latencies]),
        "client_cpu_pct": client_cpu,
        "server_cpu_pct": server_cpu,
        "machine_cpu_pct": machine_cpu,
        "cores": cores,
        "client_saturated": client_cpu >= CLIENT_SATURATED_PCT,
        "errors": errors,
    }
