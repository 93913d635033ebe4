"""One device-generator process: thousands of MQTT devices on one epoll loop.

    python -m loadtest.generator SPEC.json

There is no task and no thread per device. Each device is a socket plus a
:class:`Device` record; its heartbeats are callbacks on idlekeeper's own timing
wheel (:class:`idlekeeper.timers.Timers`, the pure part of the library, driven
by ``time.monotonic``), and one ``epoll`` waits on every socket at once. A
heartbeat costs one timer callback, one ``recv`` (the last PINGRESP) and one
``send``; pings due within ``ping_batch`` of each other share a wake-up, and an
online connection wakes the generator only when it ends. A generator holds up to
about 19,000 devices (the per-process file limit) for a few percent of a core: it
shares the machine with the server it measures, so its own wake-ups are kept few.

The spec (written by :mod:`loadtest.devices`) says which devices to run, where to
connect from (a source address of its own, so each generator has the full
ephemeral port range), how fast to ramp, and when the scenarios happen. Times are
``CLOCK_MONOTONIC`` values, which every process on the machine shares, so the
orchestrator, the generators and the stall all speak of the same instants.

Progress goes to stdout as JSON lines; the full results go to the spec's
``results`` file when the run ends.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import random
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from idlekeeper.lookahead import LookaheadWheel
from idlekeeper.timers import TimerHandle, Timers

__all__ = ["GeneratorSpec", "bind_source", "run"]

_IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
_CONNACK_OK = b"\x20\x02\x00\x00"
_PINGREQ = b"\xc0\x00"
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
# An online connection is watched for its end alone (the kernel always reports
# hang-ups and errors too): a PINGRESP does not wake the generator, and is read when
# the device next pings. Waking for each one was half of a generator's wake-ups, and
# 34 generators waking 4,000 times a second were the heaviest load on the box whose
# server they measure.
_END = select.EPOLLRDHUP
_LINGER_RST = struct.pack("ii", 1, 0)  # close() then sends RST: a device that vanished

# While ramping, the loop looks for connects to start at least this often.
_RAMP_STEP = 0.02

# Connection phases.
_CONNECTING, _HANDSHAKE, _ONLINE, _SUPERSEDED = range(4)
# servers.heartbeat's --connect-timeout default: a CONNECT sent later than this after
# the connect() is closed unanswered, and that is the generator's doing.
_SERVER_CONNECT_TIMEOUT = 10.0


def bind_source(sock: socket.socket, address: str) -> None:
    """Bind ``sock`` to the loopback source ``address``, its port picked at connect():
    a port is then needed only per 4-tuple, not per source address (so a source holds
    more than the ephemeral range, and an earlier run's TIME_WAIT sockets are no obstacle)."""
    sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
    sock.bind((address, 0))


@dataclass
class GeneratorSpec:
    """What one generator runs (JSON-serialisable; see :mod:`loadtest.devices`)."""

    index: int
    host: str
    port: int
    source: str
    first: int
    count: int
    keepalive: int
    jitter: float
    rate: float
    """Connections started per second, at most."""
    max_inflight: int
    start_at: float
    end_at: float
    results: str
    silent: list[tuple[int, float]] = field(default_factory=list)
    """(local device index, when it goes silent)."""
    vanish: list[tuple[int, float]] = field(default_factory=list)
    reconnect: list[tuple[int, float]] = field(default_factory=list)
    seed: int = 0
    prefix: str = "dev"
    ports: list[int] = field(default_factory=list)
    """A fleet's gateways: each device connects to one at random and a reconnecting
    device moves to another (empty: ``port`` alone)."""
    failover: bool = False
    """A device whose connection a gateway closes reconnects to another gateway after
    ``failover_delay`` (as real devices do when their gateway dies); each such close is
    reported in ``drops`` for the orchestrator to judge."""
    failover_delay: tuple[float, float] = (0.5, 2.0)
    """(min, max) seconds a failing-over device waits before reconnecting (uniform)."""
    ping_batch: float = 0.2
    """Seconds a PINGREQ may wait to share a wake-up with others (never early). Real
    clients are no more punctual: paho's network loop checks its keep-alive once a
    loop, up to a second apart."""


class Conn:
    """One TCP connection of a device (a device that reconnects has two for a while)."""

    __slots__ = ("device", "sock", "phase", "buf", "port")

    def __init__(self, device: Device, sock: socket.socket, port: int) -> None:
        self.device = device
        self.sock = sock
        self.phase = _CONNECTING
        self.buf = b""
        self.port = port


class Device:
    """One simulated device and what happened to it."""

    __slots__ = (
        "index",
        "client_id",
        "role",
        "conn",
        "timer",
        "last_sent",
        "max_gap",
        "connect_started",
        "connack_at",
        "closed_at",
        "acted_at",
        "takeover_s",
        "old",
        "old_closed_at",
        "attempts",
    )

    def __init__(self, index: int, client_id: str) -> None:
        self.index = index
        self.client_id = client_id
        self.role = "healthy"
        self.conn: Conn | None = None
        self.timer: TimerHandle | None = None
        self.last_sent = math.nan
        self.max_gap = 0.0
        self.connect_started = math.nan
        self.connack_at = math.nan
        self.closed_at = math.nan
        self.acted_at = math.nan  # when its scenario (silence, vanish, reconnect) happened
        self.takeover_s = math.nan
        self.old: Conn | None = None  # the superseded connection of a reconnect, until it closes
        self.old_closed_at = math.nan  # it closed before the new CONNACK came
        self.attempts = 0  # connects in a row to gateways that refused (a fleet's dead node)


def _encode_connect(client_id: str, keepalive: int) -> bytes:
    # Built here rather than imported from the server's encoders: a generator should speak
    # the wire format independently of the code it is testing.
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02" + keepalive.to_bytes(2, "big") + len(cid).to_bytes(2, "big") + cid
    return b"\x10" + bytes([len(body)]) + body


class Generator:
    """The epoll loop, the wheel of heartbeats, and the bookkeeping."""

    def __init__(self, spec: GeneratorSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed * 1_000_003 + spec.index)
        # Pings are filed ``ping_batch`` late and handed out that far early: the loop
        # wakes about once a batch for them, however many devices it runs.
        tick = 0.005
        batch = spec.ping_batch
        self.timers = Timers(time.monotonic, tick, wheel=LookaheadWheel(tick, time.monotonic(), lookahead=batch))
        self.epoll = select.epoll()
        self.conns: dict[int, Conn] = {}
        self.devices = [Device(spec.first + i, f"{spec.prefix}-{spec.first + i}") for i in range(spec.count)]
        self.started = 0
        self.inflight = 0
        self.online = 0
        self.pings = 0
        self.detected = 0
        """Silenced devices the server has closed so far."""
        self.connect_failed = 0
        self.connect_sent_late = 0
        """CONNECTs this generator sent more than the server's connect timeout after its
        own connect() (the handshake is microseconds on loopback: the delay was ours)."""
        self.connect_send_max = 0.0
        self.refused = 0
        self.errors: dict[str, int] = {}
        self.ports = list(spec.ports) or [spec.port]
        # A generator of its own for gateways, so a one-port run's jitter is what it was.
        self.port_rng = random.Random(spec.seed * 7_919 + spec.index)
        self.dead_ports: set[int] = set()
        """Gateways that refused a connection: a fleet's killed node."""
        self.drops: list[dict[str, Any]] = []
        """Failover mode: connections a gateway closed under a device that had not gone silent."""
        self.failovers = 0
        self.retries = 0
        self.window = 1.5 * spec.keepalive
        for local, at in spec.silent:
            self.devices[local].role = "silent"
            self.timers.call_at(at, self.silence, self.devices[local])
        for local, at in spec.vanish:
            self.devices[local].role = "vanish"
            self.timers.call_at(at, self.vanish, self.devices[local])
        for local, at in spec.reconnect:
            self.devices[local].role = "reconnect"
            self.timers.call_at(at, self.reconnect, self.devices[local])

    # -- connections -------------------------------------------------------------

    def pick_port(self, exclude: int | None = None) -> int:
        """A gateway for a connect: at random, not ``exclude`` nor one known dead, if another exists."""
        if len(self.ports) == 1:
            return self.ports[0]
        live = [p for p in self.ports if p != exclude and p not in self.dead_ports]
        return self.port_rng.choice(live or [p for p in self.ports if p != exclude] or self.ports)

    def open(self, device: Device, port: int | None = None) -> None:
        """Start a non-blocking connect from this generator's source address."""
        port = self.pick_port() if port is None else port
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            bind_source(sock, self.spec.source)
            sock.setblocking(False)
            code = sock.connect_ex((self.spec.host, port))
        except OSError as exc:
            sock.close()
            self.fail(device, f"connect: {errno.errorcode.get(exc.errno or 0, exc)}")
            return
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            if not self.retry(device, port, code):
                self.fail(device, f"connect: {errno.errorcode.get(code, code)}")
            return
        conn = Conn(device, sock, port)
        device.conn = conn
        if device.connack_at != device.connack_at:  # the ramp's connect, not a reconnect
            device.connect_started = time.monotonic()
        self.inflight += 1
        self.conns[sock.fileno()] = conn
        # On loopback the handshake is usually over by the time connect() returns: the
        # CONNECT goes now, as a device's would, not a loop later. (34 generators on two
        # cores, behind during a 500,000-device ramp, sent a few hundred of them over the
        # server's connect timeout after the server had accepted the socket.)
        now = time.monotonic()
        data = _encode_connect(device.client_id, self.spec.keepalive)
        try:
            sent = sock.send(data)
        except OSError:
            sent = 0  # still connecting (EAGAIN), or failing: the loop hears which
        # (A fresh socket's send buffer takes a 30-byte CONNECT whole or not at all.)
        if sent == len(data):
            self.epoll.register(sock.fileno(), _IN)
            self._stamp(device, now)
            self._connect_sent(conn, now)
        else:
            self.epoll.register(sock.fileno(), _OUT)

    def retry(self, device: Device, port: int, code: int) -> bool:
        """Failover mode: a gateway refused the connect (it is dead); try another one soon.

        False when this is not failover mode, the error is not a refusal, or the device
        has tried every gateway twice over (then it counts as a failed connect).
        """
        if not self.spec.failover or code != errno.ECONNREFUSED or device.attempts >= 2 * len(self.ports):
            return False
        self.dead_ports.add(port)
        device.attempts += 1
        self.retries += 1
        self.timers.call_at(time.monotonic() + 0.05, self.open, device, self.pick_port(exclude=port))
        return True

    def fail(self, device: Device, why: str) -> None:
        self.connect_failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1
        device.conn = None

    def drop(self, conn: Conn) -> None:
        """Forget a connection: unregister and close its socket."""
        fd = conn.sock.fileno()
        if fd >= 0:
            self.conns.pop(fd, None)
            self.epoll.unregister(fd)
        conn.sock.close()

    def on_writable(self, conn: Conn, now: float) -> None:
        err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        device = conn.device
        if err:
            self.inflight -= 1
            self.drop(conn)
            if device.conn is conn:
                device.conn = None
            if not self.retry(device, conn.port, err):
                self.fail(device, f"connect: {errno.errorcode.get(err, err)}")
            return
        self.epoll.modify(conn.sock.fileno(), _IN)
        if self.send(device, conn, _encode_connect(device.client_id, self.spec.keepalive), now):
            self._connect_sent(conn, now)

    def _connect_sent(self, conn: Conn, now: float) -> None:
        """The CONNECT is out: wait for the CONNACK, and note how long after connect() it went."""
        conn.phase = _HANDSHAKE
        device = conn.device
        if device.connack_at != device.connack_at:  # the ramp's connect
            waited = now - device.connect_started
            self.connect_send_max = max(self.connect_send_max, waited)
            self.connect_sent_late += waited > _SERVER_CONNECT_TIMEOUT

    def on_readable(self, conn: Conn, now: float) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data and conn.phase == _HANDSHAKE:
            conn.buf += data
            if len(conn.buf) < 4:
                return
            self.inflight -= 1
            if conn.buf[:4] != _CONNACK_OK:
                self.refused += 1
                self.drop(conn)
                conn.device.conn = None
                return
            self.on_connack(conn, now)
            return
        # Past the handshake only the end is reported (see _END): what came before it
        # is PINGRESPs, read and let go.
        if data and self.drain(conn):
            return
        self.on_closed(conn, now)

    def drain(self, conn: Conn) -> bool:
        """Read what the server sent (PINGRESPs) and let it go; False once it has closed.

        A short read means nothing more was waiting; an end behind it is reported by
        epoll, so one ``recv`` is the usual cost.
        """
        sock = conn.sock
        try:
            while True:
                data = sock.recv(4096)
                if not data:
                    return False
                if len(data) < 4096:
                    return True
        except BlockingIOError:
            return True
        except OSError:
            return False

    def on_connack(self, conn: Conn, now: float) -> None:
        device = conn.device
        conn.phase = _ONLINE
        conn.buf = b""
        self.epoll.modify(conn.sock.fileno(), _END)
        device.attempts = 0
        if device.connack_at != device.connack_at:  # a reconnect's CONNACK is not part of the ramp
            device.connack_at = now
        elif len(self.ports) > 1 and device.old is not None:
            # A fleet's takeover runs from here (the new gateway has the session) to the
            # old connection's close; one closed already makes it negative.
            if device.old_closed_at == device.old_closed_at:
                device.takeover_s = device.old_closed_at - now
                device.old = None
            else:
                device.acted_at = now
        self.online += 1
        self.arm(device)

    def on_closed(self, conn: Conn, now: float) -> None:
        """The server closed (or reset) ``conn``; ``now`` is when we noticed."""
        device = conn.device
        self.drop(conn)
        if conn.phase == _SUPERSEDED:
            if len(self.ports) > 1 and device.conn is not None and device.conn.phase != _ONLINE:
                device.old_closed_at = now  # before the new gateway's CONNACK: see on_connack
                return
            device.takeover_s = now - device.acted_at
            device.old = None
            return
        if conn.phase != _ONLINE:
            self.inflight -= 1
            if self.spec.failover and device.conn is conn:
                # A gateway that died during the handshake: connect to another.
                device.conn = None
                self.failovers += 1
                self.timers.call_at(now + 0.05, self.open, device, self.pick_port(exclude=conn.port))
                return
            self.fail(device, "closed during handshake")
            return
        self.online -= 1
        device.conn = None
        device.closed_at = now
        self.disarm(device)
        if device.role == "silent" and device.acted_at == device.acted_at:
            self.detected += 1
        elif self.spec.failover:
            self.fail_over(device, conn, now)

    def fail_over(self, device: Device, conn: Conn, now: float) -> None:
        """A gateway closed a device that kept its keep-alive: note it, reconnect elsewhere later."""
        self.drops.append(
            {
                "client_id": device.client_id,
                "port": conn.port,
                "at": now,
                "silent_for": round(now - device.last_sent, 3),
                "max_gap": round(device.max_gap, 3),
            }
        )
        self.failovers += 1
        # The gap to the reconnect's CONNECT is the device's own choice, not a late heartbeat.
        device.last_sent = math.nan
        low, high = self.spec.failover_delay
        self.timers.call_at(now + self.rng.uniform(low, high), self.open, device, self.pick_port(exclude=conn.port))

    # -- heartbeats and scenarios --------------------------------------------------

    def arm(self, device: Device) -> None:
        """Schedule the next PINGREQ: keep-alive after the last packet, minus jitter (as real clients do)."""
        spec = self.spec
        delay = spec.keepalive * (1.0 - spec.jitter * self.rng.random())
        device.timer = self.timers.call_at(device.last_sent + delay, self.ping, device, slack=spec.ping_batch)

    def disarm(self, device: Device) -> None:
        """Cancel the device's next PINGREQ, if one is scheduled."""
        if device.timer is not None:
            device.timer.cancel()
            device.timer = None

    def ping(self, device: Device) -> None:
        conn = device.conn
        if conn is None or conn.phase != _ONLINE:
            return
        now = time.monotonic()
        # The previous PINGRESP, read now rather than woken for (see _END). An end
        # found here is an end: it is handled as if reported.
        if not self.drain(conn):
            self.on_closed(conn, now)
            return
        if self.send(device, conn, _PINGREQ, now):
            self.pings += 1
            self.arm(device)

    def send(self, device: Device, conn: Conn, data: bytes, now: float) -> bool:
        # The time is read before send(): the bytes cannot reach the server earlier,
        # so lateness measured from it is never understated.
        try:
            conn.sock.send(data)
        except OSError:
            self.on_closed(conn, time.monotonic())
            return False
        self._stamp(device, now)
        return True

    @staticmethod
    def _stamp(device: Device, now: float) -> None:
        """``device`` sent a packet at ``now``: its longest gap between two, and its last."""
        if device.last_sent == device.last_sent:
            device.max_gap = max(device.max_gap, now - device.last_sent)
        device.last_sent = now

    def silence(self, device: Device) -> None:
        """Dead device: no packet ever again, and the socket stays open."""
        self.disarm(device)
        device.acted_at = time.monotonic()

    def vanish(self, device: Device) -> None:
        """Gone without a word: the connection ends with an RST."""
        conn = device.conn
        device.acted_at = time.monotonic()
        if conn is None or conn.phase != _ONLINE:
            return
        self.disarm(device)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        self.online -= 1
        device.conn = None
        self.drop(conn)

    def reconnect(self, device: Device) -> None:
        """A rebooted device: a new connection with the same client id, the old one left as it was."""
        conn = device.conn
        if conn is None or conn.phase != _ONLINE:
            return
        self.disarm(device)
        conn.phase = _SUPERSEDED
        self.online -= 1
        device.acted_at = time.monotonic()
        device.old = conn
        self.open(device, self.pick_port(exclude=conn.port))

    # -- the loop ----------------------------------------------------------------

    def progress(self, now: float) -> None:
        line = {
            "g": self.spec.index,
            "t": now,
            "started": self.started,
            "online": self.online,
            "failed": self.connect_failed + self.refused,
            "pings": self.pings,
            "detected": self.detected,
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    def run(self) -> dict[str, Any]:
        spec = self.spec
        # Nothing here is garbage with cycles; the collector would only add pauses.
        gc.collect()
        gc.freeze()
        gc.disable()
        next_progress = 0.0
        order = self.devices
        while True:
            now = time.monotonic()
            if now >= spec.end_at:
                break
            if self.started < len(order) and now >= spec.start_at:
                allowed = min(len(order), int((now - spec.start_at) * spec.rate) + 1)
                while self.started < allowed and self.inflight < spec.max_inflight:
                    self.open(order[self.started])
                    self.started += 1
            if now >= next_progress:
                self.progress(now)
                next_progress = now + 0.5
            # Sleep until the next thing to do: a timer, a progress line, the end, or
            # (while ramping) the next connect. A fixed 20 ms poll had 34 generators of a
            # 500,000-device run waking 1,700 times a second beside the server they measure.
            wake = min(next_progress, spec.end_at)
            if self.started < len(order):
                wake = min(wake, max(now, spec.start_at) + _RAMP_STEP)
            due = self.timers.next_deadline()
            if due is not None:
                wake = min(wake, due)
            timeout = max(0.0, wake - now)
            for fd, mask in self.epoll.poll(timeout, 4096):
                conn = self.conns.get(fd)
                if conn is None:
                    continue
                seen = time.monotonic()
                if conn.phase == _CONNECTING:
                    if mask & (_OUT | select.EPOLLERR | select.EPOLLHUP):
                        self.on_writable(conn, seen)
                else:
                    self.on_readable(conn, seen)
            self.timers.run_due(time.monotonic())
        self.progress(time.monotonic())
        return self.results()

    def results(self) -> dict[str, Any]:
        """Per-generator results; :mod:`loadtest.devices` merges them."""
        window = self.window
        lateness: list[float] = []
        undetected = 0
        false: list[dict[str, Any]] = []
        generator_late = 0
        takeovers: list[float] = []
        takeover_missed = 0
        connect_s: list[float] = []
        connack_times: list[float] = []
        silent_last: dict[str, float] = {}
        for d in self.devices:
            if d.connack_at == d.connack_at:
                connack_times.append(d.connack_at)
                if len(connect_s) < 5000:
                    connect_s.append(d.connack_at - d.connect_started)
            closed = d.closed_at == d.closed_at
            if d.role == "silent" and d.acted_at == d.acted_at:
                silent_last[d.client_id] = d.last_sent
                if closed:
                    lateness.append(d.closed_at - (d.last_sent + window))
                else:
                    undetected += 1
                continue
            if d.role == "reconnect" and d.acted_at == d.acted_at:
                if d.takeover_s == d.takeover_s:
                    takeovers.append(d.takeover_s)
                else:
                    takeover_missed += 1
            if d.role == "vanish" and d.acted_at == d.acted_at:
                continue
            if closed and not self.spec.failover:  # failover mode: the orchestrator judges self.drops
                # A device that kept to its keep-alive and was cut anyway is a false expiry;
                # one whose own heartbeat was late (an overloaded generator) is not the server's fault.
                silent_for = d.closed_at - d.last_sent
                if silent_for < window and d.max_gap < window:
                    false.append(
                        {"client_id": d.client_id, "silent_for": round(silent_for, 3), "max_gap": round(d.max_gap, 3)}
                    )
                else:
                    generator_late += 1
        for conn in list(self.conns.values()):
            self.drop(conn)
        return {
            "index": self.spec.index,
            "devices": len(self.devices),
            "connected": len(connack_times),
            "connect_failed": self.connect_failed,
            "connect_sent_late": self.connect_sent_late,
            "connect_send_max": self.connect_send_max,
            "refused": self.refused,
            "errors": self.errors,
            "first_connack": min(connack_times, default=math.nan),
            "last_connack": max(connack_times, default=math.nan),
            "connack_times": sorted(connack_times),
            "connect_s": connect_s,
            "pings": self.pings,
            "silent": len(self.spec.silent),
            "lateness": lateness,
            "silent_last": silent_last,
            "undetected": undetected,
            "vanished": len(self.spec.vanish),
            "reconnected": len(self.spec.reconnect),
            "takeover_s": takeovers,
            "takeover_missed": takeover_missed,
            "false_expiries": false,
            "generator_late": generator_late,
            "max_gap": max((d.max_gap for d in self.devices), default=0.0),
            "drops": self.drops,
            "failovers": self.failovers,
            "retries": self.retries,
            "dead_ports": sorted(self.dead_ports),
            "online_at_end": self.online,
        }


def run(spec: GeneratorSpec) -> dict[str, Any]:
    """Run one generator to its end time and return its results."""
    return Generator(spec).run()


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the spec file, run, write the results file."""
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        raw = json.load(f)
    for key in ("silent", "vanish", "reconnect"):
        raw[key] = [tuple(pair) for pair in raw.get(key, [])]
    if "failover_delay" in raw:
        raw["failover_delay"] = tuple(raw["failover_delay"])
    spec = GeneratorSpec(**raw)
    results = run(spec)
    with open(spec.results, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
