"""``python -m loadtest qos``: QoS 1 throughput and memory per queued message, ours beside Mosquitto.

    python -m loadtest qos [--publishers 4] [--duration 10] [--queued 50000] [--targets idlekeeper,mosquitto,...]

**Throughput**: P publisher connections publish QoS 1 messages to ``bench/<n>``, each
keeping at most ``--window`` PUBLISHes unacknowledged by the server; one subscriber
on ``bench/#`` at QoS 1 acknowledges every delivery. Every payload carries its
publisher, its sequence number and its send time, so the subscriber counts each
message (exactly once: no loss, no duplicate), its order per publisher, and its
publish-to-deliver latency. The rate is counted at the subscriber after a warm-up.
Publishers also wait while ``--outstanding`` messages (by default P x window) are
published and not yet delivered: a broker acknowledges a PUBLISH on receipt, so
publishers faster than the subscriber would fill its queue (1,000 at both
brokers) and messages would be dropped by design. The cap keeps the run closed-loop
and loss-free, and bounds what can wait in the server: the latency is that of a
saturated server with at most that many messages in it (Little's law: cap =
rate x latency). A larger cap lets a server that takes PUBLISHes faster than it
delivers them build a queue, and the latency grows with it.

All clients run in this one process: raw non-blocking sockets on one ``epoll``,
packets framed with :mod:`servers.heartbeat.encoders`, several packets per read
and one write per batch of acknowledgements. Its CPU over the measured window is
reported beside the server's: a client near 100% of a core is the bottleneck, and
the rate is then a lower bound for that target.

**Queued messages**: a persistent session (CleanSession=0) subscribes to ``q/#`` at
QoS 1 and disconnects; N QoS 1 messages are published while it is away, and the
server's RSS (psutil, every process) before and after gives bytes per queued
message. The client then reconnects with CleanSession=0, must see session-present
1, and must receive all N, in order, exactly once.

Targets: ``idlekeeper`` is ``servers.heartbeat`` with ``--workers 1`` on its dense
engine; ``mosquitto`` is the Debian broker with a minimal configuration
(``max_inflight_messages 20``, ``max_queued_messages`` 1,000, or N for the queued
part). Each part gets a fresh server, so the RSS baseline is a clean one.

Mosquitto 2.0.11 (Debian's, and the version measured here) reorders QoS 1 messages
once some wait in its queue behind a full in-flight window: a new message is sent
as soon as the window has room (``db__ready_for_flight`` checks the quota, not the
queue), ahead of those queued; with several publishers, some queued ones were still
unsent seconds after the last publish. The run reports them as out of order and
lost rather than hiding them, and since they count as undelivered, they also eat
into ``--outstanding``. ``mosquitto-inflight0`` is the same broker with
``max_inflight_messages 0`` (no bound, so a connected subscriber's messages never
queue): it delivers exactly once and in order, and gives a throughput untouched by
the defect. Later releases reworked the in-flight quota code; only the installed
2.0.11 is measured.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import gc
import json
import math
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from servers.heartbeat.encoders import (
    encode_connect,
    encode_disconnect,
    encode_puback,
    encode_publish,
    encode_subscribe,
)

from .compare import skip_reason, table
from .mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from .processes import free_port, start_heartbeat
from .stats import summary_ms

__all__ = [
    "PAYLOAD_HEADER",
    "QOS_COLUMNS",
    "QOS_TARGETS",
    "QosLoad",
    "describe",
    "frames",
    "main",
    "publish_prefix",
    "qos_row",
    "qos_table",
    "run_qos",
    "run_queued",
    "run_throughput",
    "start_qos_target",
]

QOS_TARGETS = ("idlekeeper", "mosquitto", "mosquitto-inflight0")
PARTS = ("throughput", "queued")

PAYLOAD_HEADER = struct.Struct("!IIQ")
"""What starts every payload: publisher index, sequence number, send time (``monotonic_ns``)."""

KEEP_ALIVE = 600
"""Long enough that no client needs to ping during a run."""
QUEUE_FILL_WINDOW = 100
"""PUBLISHes the queue filler keeps unacknowledged: the fill is a set-up step, not measured."""
RECV_SIZE = 256 * 1024
CLIENT_SATURATED_PCT = 90.0
"""Client CPU (% of one core) from which the client, not the server, sets the rate."""


@dataclass
class QosLoad:
    """The QoS workload; ``loadtest qos`` and ``loadtest compare`` take flags and defaults from here."""

    publishers: int = 4
    """Publisher connections."""
    payload: int = 64
    """Payload bytes per message (at least the 16-byte header)."""
    window: int = 10
    """PUBLISHes each publisher keeps unacknowledged by the server."""
    outstanding: int = 0
    """Messages published and not yet delivered, over all publishers, at most (0: publishers x window)."""
    duration: float = 10.0
    """Seconds of publishing (the warm-up included)."""
    count: int = 0
    """Messages to publish in all; the run ends at whichever of this and ``duration`` comes first (0: no count)."""
    warmup: float = 1.0
    """Seconds at the start not counted in the rate or the latency (at most half of ``duration``)."""
    queued: int = 50_000
    """Messages queued for the absent persistent session (at least 1)."""
    inflight: int = 20
    """The servers' in-flight window per subscriber (``--max-inflight``, ``max_inflight_messages``)."""
    max_queued: int = 1000
    """The servers' queue per subscriber during the throughput part."""

    def __post_init__(self) -> None:
        if self.payload < PAYLOAD_HEADER.size:
            raise ValueError(f"payload must hold the {PAYLOAD_HEADER.size}-byte header")
        if min(self.publishers, self.window, self.queued) < 1 or self.outstanding < 0:
            raise ValueError("publishers, window and queued must be at least 1, outstanding at least 0")
        if self.cap >= self.max_queued + self.inflight:
            # Beyond this a broker may drop by its own rules, and loss would mean nothing.
            raise ValueError("outstanding must stay below the servers' queue plus in-flight window")

    @property
    def cap(self) -> int:
        """The bound on undelivered messages in force."""
        return self.outstanding or self.publishers * self.window

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """Add the workload's flags, each named ``--<prefix><name>``."""
        d = QosLoad()
        a = parser.add_argument
        a(f"--{prefix}publishers", type=int, default=d.publishers, help=f"publishers (default: {d.publishers})")
        a(f"--{prefix}payload", type=int, default=d.payload, help=f"payload bytes (default: {d.payload})")
        a(
            f"--{prefix}window",
            type=int,
            default=d.window,
            help=f"unacknowledged PUBLISHes per publisher (default: {d.window})",
        )
        a(
            f"--{prefix}outstanding",
            type=int,
            default=d.outstanding,
            help="published and not yet delivered, over all publishers (default: 0, publishers x window)",
        )
        a(
            f"--{prefix}duration",
            type=float,
            default=d.duration,
            help=f"seconds of publishing (default: {d.duration:g})",
        )
        a(f"--{prefix}count", type=int, default=d.count, help="stop after this many messages (default: 0, none)")
        a(f"--{prefix}warmup", type=float, default=d.warmup, help=f"seconds not counted (default: {d.warmup:g})")
        a(
            f"--{prefix}queued",
            type=int,
            default=d.queued,
            help=f"messages queued for the absent persistent session (default: {d.queued:,})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> QosLoad:
        """The workload from flags added by :meth:`add_arguments` with the same ``prefix``."""
        p = prefix.replace("-", "_")
        names = ("publishers", "payload", "window", "outstanding", "duration", "count", "warmup", "queued")
        return cls(**{name: getattr(args, f"{p}{name}") for name in names})


# -- wire ---------------------------------------------------------------------------------


def frames(buf: bytearray | bytes) -> tuple[list[tuple[int, int, int]], int]:
    """The whole packets at the start of ``buf``: (first byte, body start, body end) each,
    and how many bytes they take. Offsets rather than copies: the subscriber reads
    tens of thousands of packets a second straight out of its buffer."""
    out: list[tuple[int, int, int]] = []
    i = 0
    n = len(buf)
    while i + 2 <= n:
        length = 0
        shift = 0
        j = i + 1
        while True:
            if j >= n:
                return out, i
            byte = buf[j]
            j += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 21:
                raise ValueError("malformed remaining length")
        end = j + length
        if end > n:
            break
        out.append((buf[i], j, end))
        i = end
    return out, i


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
        raise RuntimeError(f"CONNACK refused {client_id!r}: {connack.hex()}")
    return sock, bool(connack[2] & 1)


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


# -- the server's side ----------------------------------------------------------------------


def _cpu_seconds(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _rss(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


def settled_rss(pids: Sequence[int], pause: float = 0.5) -> int:
    """RSS of ``pids`` once the server had ``pause`` to finish what it was doing;
    the lower of two readings, so a transient allocation is not counted."""
    time.sleep(pause)
    first = _rss(pids)
    time.sleep(0.1)
    return min(first, _rss(pids))


def start_qos_target(name: str, queued: int, inflight: int = 20, queued_bytes: int = 0) -> MqttTarget:
    """Start ``name`` on a free loopback port with ``queued`` messages allowed per client
    and ``inflight`` in flight to each (``mosquitto-inflight0``: no in-flight bound).

    ``queued_bytes`` is our server's per-client byte bound (0: our default of 16 MiB);
    Mosquitto's ``max_queued_bytes`` is left unbounded, as it is by default.
    """
    port = free_port()
    if name == "idlekeeper":
        extra = ["--engine", "dense", "--max-inflight", str(inflight), "--max-queued", str(queued)]
        if queued_bytes:
            extra += ["--max-queued-bytes", str(queued_bytes)]
        return MqttTarget(name, start_heartbeat(port, 1, extra), port)
    if name not in ("mosquitto", "mosquitto-inflight0"):
        raise PeerUnavailable(f"unknown QoS target {name!r} (known: {', '.join(QOS_TARGETS)})")
    if name == "mosquitto-inflight0":
        # 0 is "no maximum": a connected subscriber's messages never wait in Mosquitto's
        # queue, whose 2.0.11 code reorders and strands QoS 1 messages (see the module doc).
        inflight = 0
    return start_mosquitto(name, port, f"max_inflight_messages {inflight}\nmax_queued_messages {queued}\n")


# -- throughput ---------------------------------------------------------------------------------


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


class _Tally:
    """What the subscriber saw of one publisher's sequence: exactly once, in order."""

    __slots__ = ("ahead", "contiguous", "duplicates", "out_of_order")

    def __init__(self) -> None:
        self.contiguous = 0
        """Sequence numbers 0 .. contiguous - 1 have all arrived."""
        self.ahead: set[int] = set()
        """Arrived beyond a gap."""
        self.duplicates = 0
        self.out_of_order = 0

    def see(self, seq: int) -> None:
        """One delivery of ``seq``."""
        if seq == self.contiguous:
            self.contiguous += 1
            ahead = self.ahead
            while ahead and self.contiguous in ahead:
                ahead.remove(self.contiguous)
                self.contiguous += 1
        elif seq < self.contiguous or seq in self.ahead:
            self.duplicates += 1
        else:
            self.ahead.add(seq)
            self.out_of_order += 1

    @property
    def unique(self) -> int:
        """Distinct sequence numbers seen."""
        return self.contiguous + len(self.ahead)


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
    tallies = [_Tally() for _ in range(load.publishers)]
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
        client, server_cpu = time.process_time(), _cpu_seconds(server)
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


# -- queued messages -------------------------------------------------------------------------------


def _publish_all(sock: socket.socket, topic: str, n: int, payload: int, window: int) -> None:
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


def _receive_all(sock: socket.socket, n: int, idle: float) -> dict[str, Any]:
    """Take deliveries (acknowledging each) until ``n`` distinct ones came or ``idle`` seconds pass without one."""
    tally = _Tally()
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
        packets, used = frames(buf)
        acks = []
        for first, start, end in packets:
            if first >> 4 != 3:
                continue
            offset = start + 2 + ((buf[start] << 8) | buf[start + 1])
            if (first >> 1) & 3:
                acks.append(encode_puback(int.from_bytes(buf[offset : offset + 2], "big")))
                offset += 2
            if first & 0x08:
                dup_flag += 1
            if end - offset >= PAYLOAD_HEADER.size:
                tally.see(PAYLOAD_HEADER.unpack_from(buf, offset)[1])
                received += 1
        del buf[:used]
        if acks:
            sock.sendall(b"".join(acks))
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
        _publish_all(publisher, "q/m", load.queued, load.payload, QUEUE_FILL_WINDOW)
        fill_s = time.monotonic() - t0
        after = settled_rss(pids)
        t0 = time.monotonic()
        back, present = open_client(port, client_id, clean=False, timeout=60.0)
        try:
            got = _receive_all(back, load.queued, idle=5.0)
            drain_s = time.monotonic() - t0
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
        **got,
        "lost": lost,
        "in_order": got["out_of_order"] == 0 and got["duplicates"] == 0,
        "drain_s": drain_s,
        "drain_msgs_per_s": got["unique"] / drain_s if drain_s > 0 else math.nan,
        "ok": present and lost == 0 and got["out_of_order"] == 0 and got["duplicates"] == 0,
    }


# -- both parts, every target ----------------------------------------------------------------------


@contextlib.contextmanager
def _target(name: str, queued: int, inflight: int, queued_bytes: int = 0) -> Iterator[MqttTarget]:
    started = start_qos_target(name, queued, inflight, queued_bytes)
    try:
        yield started
    finally:
        started.stop()


def run_qos(
    load: QosLoad, targets: Sequence[str] = QOS_TARGETS, parts: Sequence[str] = PARTS, quiet: bool = False
) -> dict[str, Any]:
    """Both parts against each target in turn; runs, table rows, targets not run, and the table."""
    runs: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    # Room for every queued message's topic and payload, whatever the payload size.
    queued_bytes = max(16 * 1024 * 1024, 2 * load.queued * (load.payload + 8))
    for name in targets:
        run: dict[str, Any] = {}
        try:
            if "throughput" in parts:
                print(f"\n== qos throughput: {name} ==", flush=True)
                with _target(name, load.max_queued, load.inflight) as t:
                    show = None if quiet else (lambda line: print(line, flush=True))
                    run["throughput"] = run_throughput(t.port, t.pids(), load, tag=name, show=show)
            if "queued" in parts:
                print(f"\n== qos queued: {name} ==", flush=True)
                with _target(name, max(load.queued, load.max_queued), load.inflight, queued_bytes) as t:
                    run["queued"] = run_queued(t.port, t.pids(), load, tag=name)
        except (RuntimeError, OSError) as exc:
            # One target that cannot run (or fails on the way) leaves the others' figures.
            missing[name] = skip_reason(exc)
            print(f"   skipped: {exc}", flush=True)
            continue
        run["target"] = name
        print(describe(run), flush=True)
        runs[name] = run
    rows = {name: qos_row(r) for name, r in runs.items()}
    return {"load": asdict(load), "runs": runs, "rows": rows, "missing": missing, "table": qos_table(rows, missing)}


QOS_COLUMNS = (
    ("msgs_per_s", "QoS 1 msg/s", "", True),
    ("latency_p50_ms", "latency p50", "ms", False),
    ("latency_p99_ms", "latency p99", "ms", False),
    ("lost", "lost", "", False),
    ("duplicates", "duplicated", "", False),
    ("out_of_order", "out of order", "", False),
    ("server_cpu_pct", "server CPU", "% core", False),
    ("client_cpu_pct", "client CPU", "% core", False),
    ("bytes_per_queued", "RSS per queued msg", "B", False),
    ("queued_lost", "queued lost", "", False),
    ("queued_out_of_order", "queued out of order", "", False),
    ("drain_msgs_per_s", "queue drain msg/s", "", True),
)


COUNTS = frozenset({"lost", "duplicates", "out_of_order", "queued_lost", "queued_out_of_order"})
"""Columns that count failures: 0 is the only good figure, and a ratio of them says nothing."""


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def qos_row(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one target's run that go into the table."""
    t = r.get("throughput", {})
    q = r.get("queued", {})
    late = t.get("latency_ms", {})
    return {
        "msgs_per_s": _num(t.get("msgs_per_s")),
        "latency_p50_ms": _num(late.get("p50")),
        "latency_p99_ms": _num(late.get("p99")),
        "lost": _num(t.get("lost")),
        "duplicates": _num(t.get("duplicates")),
        "out_of_order": _num(t.get("out_of_order")),
        "server_cpu_pct": _num(t.get("server_cpu_pct")),
        "client_cpu_pct": _num(t.get("client_cpu_pct")),
        "bytes_per_queued": _num(q.get("bytes_per_queued")),
        "queued_lost": _num(q.get("lost")),
        "queued_out_of_order": _num(q.get("out_of_order")),
        "drain_msgs_per_s": _num(q.get("drain_msgs_per_s")),
    }


def qos_table(rows: dict[str, dict[str, float]], missing: dict[str, str]) -> str:
    """:func:`loadtest.compare.table` (each figure with its ratio to ours), then for each
    peer that ran a row of ours / the peer's, figure by figure."""
    lines = [table(rows, QOS_COLUMNS, missing)]
    ours = rows.get("idlekeeper")
    for peer, theirs in rows.items():
        if ours is None or peer == "idlekeeper":
            continue
        cells = []
        for key, _, _, _ in QOS_COLUMNS:
            a, b = ours.get(key, math.nan), theirs.get(key, math.nan)
            usable = key not in COUNTS and a == a and b == b and b != 0
            cells.append(f"{a / b:.2f}×" if usable else "—")
        lines.append(f"| idlekeeper / {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(r: dict[str, Any]) -> str:
    """A short human-readable report of one target's run."""
    lines = [f"target                 {r['target']}"]
    t = r.get("throughput")
    if t:
        late = t["latency_ms"]
        lines.append(
            f"QoS 1 throughput       {t['msgs_per_s']:,.0f} msg/s delivered over {t['window_s']:.1f} s "
            f"({t['publishers']} publishers x {t['window']} unacknowledged, {t['payload_bytes']} B payloads, "
            f"at most {t['outstanding']} undelivered)"
        )
        if late.get("n"):
            lines.append(
                f"publish -> deliver     p50 {late['p50']:.2f} ms, p99 {late['p99']:.2f} ms, max {late['max']:.1f} ms"
            )
        verdict = "exactly once" if t["exactly_once"] else "NOT exactly once"
        lines.append(
            f"delivery               {verdict}: {t['published']:,} published, {t['unique']:,} delivered, "
            f"{t['lost']} lost, {t['duplicates']} duplicated, {t['out_of_order']} out of order"
        )
        bound = "client-bound: a lower bound" if t["client_saturated"] else "the client is not the bottleneck"
        if t["machine_cpu_pct"] >= CLIENT_SATURATED_PCT:
            bound += f"; all {t['cores']} cores busy"
        lines.append(
            f"CPU                    server {t['server_cpu_pct']:.0f}% of a core, client {t['client_cpu_pct']:.0f}%, "
            f"machine {t['machine_cpu_pct']:.0f}% of {t['cores']} cores "
            f"({bound})"
        )
        for error in t["errors"]:
            lines.append(f"error                  {error}")
    q = r.get("queued")
    if q:
        lines.append(
            f"queued while away      {q['queued']:,} messages: {q['bytes_per_queued']:,.0f} B of RSS each "
            f"({q['rss_before_bytes'] / 2**20:.1f} -> {q['rss_queued_bytes'] / 2**20:.1f} MiB)"
        )
        lines.append(
            f"on return              session present {int(q['session_present'])}, {q['unique']:,} delivered "
            f"in {q['drain_s']:.2f} s ({q['drain_msgs_per_s']:,.0f} msg/s), {q['lost']} lost, "
            f"{q['duplicates']} duplicated, {q['out_of_order']} out of order"
        )
    return "\n".join(lines)


def headline(load: QosLoad) -> str:
    """The line above the table: what the workload was."""
    return (
        f"QoS 1: {load.publishers} publishers x {load.window} unacknowledged, {load.payload} B payloads, "
        f"{load.duration:g} s ({load.warmup:g} s warm-up), at most {load.cap} undelivered; "
        f"{load.queued:,} messages queued for an absent persistent session"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest qos``; exit 0 only if our server delivered exactly once (and in order when
    queued). A peer's failures are reported, not fatal: the run measures them."""
    p = argparse.ArgumentParser(prog="python -m loadtest qos", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--targets", default=",".join(QOS_TARGETS), help=f"comma-separated (default: {','.join(QOS_TARGETS)})")
    a("--parts", default=",".join(PARTS), help="comma-separated: throughput, queued (default: both)")
    QosLoad.add_arguments(p)
    a("--json", default="results/qos.json", help="JSON results; the table goes next to it as .md")
    a("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    try:
        load = QosLoad.from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    out = run_qos(load, args.targets.split(","), parts, args.quiet)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=float))
    text = headline(load) + "\n\n" + out["table"]
    path.with_suffix(".md").write_text(text + "\n")
    print("\n" + text)
    print(f"\nwritten                {path}, {path.with_suffix('.md')}")
    ours = out["runs"].get("idlekeeper")
    if ours is None:
        return 1 if "idlekeeper" in out["missing"] or not out["runs"] else 0
    ok = ours.get("throughput", {}).get("exactly_once", True) and ours.get("queued", {}).get("ok", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
