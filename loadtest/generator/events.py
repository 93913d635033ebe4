"""What a device generator does on each event: a socket ready, a heartbeat due, a
scenario's time come (:mod:`loadtest.generator.loop` runs the loop that waits for them).

There is no task and no thread per device. Each device is a socket plus a
:class:`~loadtest.generator.records.Device` record; its heartbeats are callbacks on
idlekeeper's own timing wheel (:class:`idlekeeper.timers.Timers`, the pure part of the
library, driven by ``time.monotonic``). A heartbeat costs one timer callback, one
``recv`` (the last PINGRESP) and one ``send``; pings due within ``ping_batch`` of each
other share a wake-up, and an online connection wakes the generator only when it ends.
"""

from __future__ import annotations

import errno
import math
import random
import select
import socket
import struct
import time
from typing import Any

from idlekeeper.lookahead import LookaheadWheel
from idlekeeper.timers import Timers

from . import mqtt5
from .inbound import drain, drain_v5, read_v5
from .records import (
    CONNACK_OK,
    HANDSHAKE,
    ONLINE,
    PINGREQ,
    SUPERSEDED,
    Conn,
    Device,
    encode_connect,
)
from .source import bind_source
from .spec import GeneratorSpec

__all__ = ["Generator"]

_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
# An online connection is watched for its end alone (the kernel always reports
# hang-ups and errors too): a PINGRESP does not wake the generator, and is read when
# the device next pings. Waking for each one was half of a generator's wake-ups, and
# 34 generators waking 4,000 times a second were the heaviest load on the box whose
# server they measure.
_END = select.EPOLLRDHUP
_LINGER_RST = struct.pack("ii", 1, 0)  # close() then sends RST: a device that vanished

# servers.heartbeat's --connect-timeout default: a CONNECT sent later than this after
# the connect() is closed unanswered, and that is the generator's doing.
_SERVER_CONNECT_TIMEOUT = 10.0


class Generator:
    """A generator's devices: what each socket event, heartbeat and scenario does to them
    (:mod:`loadtest.generator.loop` runs the loop that calls these; what they add up to is
    :func:`loadtest.generator.report.generator_results`)."""

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
        # One bound method per version, shared by its devices: a heartbeat looks nothing up.
        pingers = {3: self.ping, 4: self.ping, 5: self.ping_v5}
        versions = spec.versions or "4" * spec.count
        k = spec.keepalive
        self.devices = [
            Device(spec.first + i, f"{spec.prefix}-{spec.first + i}", k, int(v), pingers[int(v)])
            for i, v in zip(range(spec.count), versions, strict=True)
        ]
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
        self.refusals: dict[str, int] = {}
        """Refused connects by the server's answer: ``3.x CONNACK 2``, ``5.0 CONNACK 0x87 not-authorized``."""
        self.disconnects: dict[str, dict[str, int]] = {}
        """5.0 devices: the server's DISCONNECTs by reason code, then by the device's role."""
        self.server_keepalive: dict[str, int] = {}
        """5.0 devices the server told to ping at another keep-alive (Server Keep Alive), by its value."""
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
        data = self.connect_packet(device)
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
        """A connect that failed for good: counted by ``why``, and the device left unconnected."""
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
        """A connect() came to an end: on success the CONNECT goes out; on failure the device
        tries another gateway (failover mode) or counts as failed."""
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
        if self.send(device, conn, self.connect_packet(device), now):
            self._connect_sent(conn, now)

    def connect_packet(self, device: Device) -> bytes:
        """The device's CONNECT, in its version."""
        if device.version == 5:
            return mqtt5.encode_connect(device.client_id, self.spec.keepalive)
        return encode_connect(device.client_id, self.spec.keepalive, device.version)

    def _connect_sent(self, conn: Conn, now: float) -> None:
        """The CONNECT is out: wait for the CONNACK, and note how long after connect() it went."""
        conn.phase = HANDSHAKE
        device = conn.device
        if device.connack_at != device.connack_at:  # the ramp's connect
            waited = now - device.connect_started
            self.connect_send_max = max(self.connect_send_max, waited)
            self.connect_sent_late += waited > _SERVER_CONNECT_TIMEOUT

    def on_readable(self, conn: Conn, now: float) -> None:
        """Bytes or an end on ``conn``: the CONNACK in the handshake, the server's close after it."""
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data and conn.phase == HANDSHAKE:
            conn.buf += data
            if conn.device.version == 5:
                self.on_answer_v5(conn, now)
                return
            if len(conn.buf) < 4:
                return
            self.inflight -= 1
            if conn.buf[:4] != CONNACK_OK:
                self.refuse(conn, f"3.x CONNACK {conn.buf[3]}" if conn.buf[:3] == b"\x20\x02\x00" else "not a CONNACK")
                return
            self.on_connack(conn, now)
            return
        if conn.device.version == 5:
            # A 5.0 server may say why it closes: a DISCONNECT, read and counted.
            if data and drain_v5(self.disconnects, conn, data):
                return
            self.on_closed(conn, now)
            return
        # Past the handshake only the end is reported (see _END): what came before it
        # is PINGRESPs, read and let go.
        if data and drain(conn):
            return
        self.on_closed(conn, now)

    def refuse(self, conn: Conn, answer: str) -> None:
        """The server refused the device's CONNECT with ``answer``: counted, and the connection let go."""
        self.refused += 1
        self.refusals[answer] = self.refusals.get(answer, 0) + 1
        self.drop(conn)
        conn.device.conn = None

    def on_answer_v5(self, conn: Conn, now: float) -> None:
        """Bytes in a 5.0 handshake: once the answer is whole, the device is online (at the
        server's keep-alive, if its CONNACK gave one) or refused, by what the answer was."""
        answer = mqtt5.read_connack(conn.buf)
        if answer is None:
            return
        self.inflight -= 1
        if not answer.accepted:
            self.refuse(conn, answer.label)
            return
        device = conn.device
        told = answer.server_keep_alive
        device.keepalive = self.spec.keepalive if told is None else told
        if told is not None:
            self.server_keepalive[str(told)] = self.server_keepalive.get(str(told), 0) + 1
        rest = conn.buf[answer.used :]
        self.on_connack(conn, now)
        if rest:
            conn.buf = read_v5(self.disconnects, conn, rest)

    def on_connack(self, conn: Conn, now: float) -> None:
        """The server accepted the device: it is online and its heartbeats start."""
        device = conn.device
        conn.phase = ONLINE
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
        if device.keepalive:  # a Server Keep Alive of 0: no keep-alive, no heartbeats
            self.arm(device)

    def on_closed(self, conn: Conn, now: float) -> None:
        """The server closed (or reset) ``conn``; ``now`` is when we noticed."""
        device = conn.device
        self.drop(conn)
        if conn.phase == SUPERSEDED:
            if len(self.ports) > 1 and device.conn is not None and device.conn.phase != ONLINE:
                device.old_closed_at = now  # before the new gateway's CONNACK: see on_connack
                return
            device.takeover_s = now - device.acted_at
            device.old = None
            return
        if conn.phase != ONLINE:
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
        delay = device.keepalive * (1.0 - spec.jitter * self.rng.random())
        device.timer = self.timers.call_at(device.last_sent + delay, device.pinger, device, slack=spec.ping_batch)

    def disarm(self, device: Device) -> None:
        """Cancel the device's next PINGREQ, if one is scheduled."""
        if device.timer is not None:
            device.timer.cancel()
            device.timer = None

    def ping(self, device: Device) -> None:
        """A heartbeat due: the last PINGRESP read, a PINGREQ sent, the next one scheduled."""
        conn = device.conn
        if conn is None or conn.phase != ONLINE:
            return
        now = time.monotonic()
        # The previous PINGRESP, read now rather than woken for (see _END). An end
        # found here is an end: it is handled as if reported.
        if not drain(conn):
            self.on_closed(conn, now)
            return
        if self.send(device, conn, PINGREQ, now):
            self.pings += 1
            self.arm(device)

    def ping_v5(self, device: Device) -> None:
        """:meth:`ping` for a 5.0 device: what the server sent since is read for a DISCONNECT."""
        conn = device.conn
        if conn is None or conn.phase != ONLINE:
            return
        now = time.monotonic()
        if not drain_v5(self.disconnects, conn):
            self.on_closed(conn, now)
            return
        if self.send(device, conn, PINGREQ, now):
            self.pings += 1
            self.arm(device)

    def send(self, device: Device, conn: Conn, data: bytes, now: float) -> bool:
        """Send ``data`` for ``device`` as of ``now``; False if the connection turned out closed."""
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
        if conn is None or conn.phase != ONLINE:
            return
        self.disarm(device)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        self.online -= 1
        device.conn = None
        self.drop(conn)

    def reconnect(self, device: Device) -> None:
        """A rebooted device: a new connection with the same client id, the old one left as it was."""
        conn = device.conn
        if conn is None or conn.phase != ONLINE:
            return
        self.disarm(device)
        conn.phase = SUPERSEDED
        self.online -= 1
        device.acted_at = time.monotonic()
        device.old = conn
        self.open(device, self.pick_port(exclude=conn.port))
