"""The MQTT canary of ``python -m loadtest fuzz`` (:mod:`.canary`): devices pinging
with a keep-alive the server holds them to, a subscriber to their presence topics
that must hear them come online and never go offline (none against a peer that
publishes no presence), and a new connection every
:data:`~.canary_base.PROBE_INTERVAL` s that must get CONNACK 0; over TCP, or every one
of them over WebSockets.
"""

from __future__ import annotations

import collections
import json

import trio

from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX

from ..mqtt_frames import frames
from .canary_base import CANARY_LATENCY, Canary

__all__ = ["CANARY_DEVICES", "CANARY_INTERVAL", "CANARY_KEEPALIVE", "MqttCanary"]

CANARY_DEVICES = 3
CANARY_KEEPALIVE = 2
"""The canary's keep-alive (s): within the server's ``--max-keepalive`` cap, so it is
held to the same 3 s window as every fuzz connection."""
CANARY_INTERVAL = 0.5


class _MqttClient:
    """One canary connection: a reader that frames the server's packets, pings FIFO-matched."""

    def __init__(self, canary: MqttCanary, name: str, stream: trio.abc.Stream) -> None:
        self.canary = canary
        self.name = name
        self.stream = stream
        self.connack = trio.Event()
        self.suback = trio.Event()
        self.code = -1
        self.pings: collections.deque[float] = collections.deque()
        self.closed = False
        self.sending = trio.StrictFIFOLock()  # the pinger, SUBSCRIBE and DISCONNECT share the stream

    async def send(self, data: bytes) -> bool:
        """Send ``data``; False if the connection is gone."""
        async with self.sending:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return True

    async def read(self) -> None:
        buf = bytearray()
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.closed = True
                if not self.canary.stopping:
                    self.canary.problem(f"the server closed {self.name}")
                return
            buf += data
            found, used = frames(buf)
            for first, start, end in found:
                self.packet(first >> 4, bytes(buf[start:end]))
            del buf[:used]

    def packet(self, kind: int, body: bytes) -> None:
        now = trio.current_time()
        if kind == 0x2 and len(body) == 2:
            self.code = body[1]
            self.connack.set()
        elif kind == 0x9:
            self.suback.set()
        elif kind == 0xD and self.pings:
            self.canary.latency(now - self.pings.popleft())
            self.canary.report.exchanges += 1
        elif kind == 0x3:
            size = int.from_bytes(body[:2], "big")
            self.canary.presence(body[2 : 2 + size].decode(errors="replace"), body[2 + size :])

    async def ping(self) -> None:
        last = trio.current_time()
        while not self.closed:
            await trio.sleep(CANARY_INTERVAL)
            now = trio.current_time()
            # Silent for the server's whole window (1.5 x keep-alive): a drop would be ours.
            self.canary.gap(now - last, 1.5 * CANARY_KEEPALIVE)
            last = now
            if self.pings and now - self.pings[0] > CANARY_LATENCY:
                self.canary.problem(f"{self.name}: no PINGRESP for {now - self.pings[0]:.1f} s")
                self.pings.clear()
            self.pings.append(now)
            if not await self.send(encoders.encode_pingreq()):
                return


class MqttCanary(Canary):
    """Well-behaved MQTT clients beside the fuzzer: :data:`CANARY_DEVICES` devices pinging
    every :data:`CANARY_INTERVAL` s with keep-alive :data:`CANARY_KEEPALIVE`, a subscriber
    to their presence topics that must hear them come online and never go offline, and a
    new connection every :data:`~.canary_base.PROBE_INTERVAL` s that must be accepted."""

    def __init__(self, port: int, tag: str, presence: bool = True, ws_path: str | None = None) -> None:
        super().__init__(port, tag, "mqtt")
        self.with_presence = presence
        """Whether the server publishes presence, and a subscriber must hear it."""
        self.ws_path = ws_path
        """Where MQTT over WebSockets is served, if the port is a WebSocket listener."""
        self.ids = [f"canary-{tag}-{i}" for i in range(CANARY_DEVICES)]
        self.clients: list[_MqttClient] = []
        self.online: set[str] = set()

    def presence(self, topic: str, payload: bytes) -> None:
        """A presence event for one of the canary devices."""
        try:
            event = json.loads(payload)
        except ValueError:
            self.problem(f"unreadable presence payload on {topic}")
            return
        client_id = str(event.get("client_id"))
        if event.get("status") == "online":
            self.online.add(client_id)
            self.report.online_seen = len(self.online)
        elif event.get("status") == "offline" and not (self.stopping and event.get("reason") == "disconnect"):
            self.report.false_offline.append(f"{client_id} ({event.get('reason')})")

    async def open(self) -> trio.abc.Stream:
        """A connection to the server: TCP, or a WebSocket carrying MQTT."""
        if self.ws_path is None:
            return await super().open()
        return await self.open_ws(self.ws_path, ("mqtt",))

    async def _client(self, nursery: trio.Nursery, client_id: str) -> _MqttClient:
        stream = await self.open()
        client = _MqttClient(self, client_id, stream)
        nursery.start_soon(client.read)
        await client.send(encoders.encode_connect(client_id, keep_alive=CANARY_KEEPALIVE))
        with trio.move_on_after(CANARY_LATENCY):
            await client.connack.wait()
        if client.code != 0:
            raise RuntimeError(f"canary {client_id} was not accepted (CONNACK {client.code})")
        self.clients.append(client)
        nursery.start_soon(client.ping)
        return client

    async def start(self, nursery: trio.Nursery) -> None:
        """Connect the subscriber, then the devices; return once the subscriber heard them online."""
        if not self.with_presence:
            self.report.clients = CANARY_DEVICES
            for client_id in self.ids:
                await self._client(nursery, client_id)
            nursery.start_soon(self._probe)
            return
        self.report.clients = CANARY_DEVICES + 1
        sub = await self._client(nursery, f"canary-{self.tag}-sub")
        await sub.send(encoders.encode_subscribe(1, [(f"{DEFAULT_PRESENCE_PREFIX}{i}", 0) for i in self.ids]))
        with trio.move_on_after(CANARY_LATENCY):
            await sub.suback.wait()
        for client_id in self.ids:
            await self._client(nursery, client_id)
        with trio.move_on_after(CANARY_LATENCY):
            while len(self.online) < len(self.ids):  # noqa: ASYNC110 - a handful of events, once
                await trio.sleep(0.05)
        if len(self.online) < len(self.ids):
            self.problem(f"the subscriber heard {len(self.online)} of {len(self.ids)} canaries come online")
        nursery.start_soon(self._probe)

    async def _probe_once(self) -> str:
        """CONNECT on a new connection and DISCONNECT: ``connack-<rc>``, or what else came."""
        stream = await self.open()
        try:
            await stream.send_all(encoders.encode_connect(f"canary-{self.tag}-probe", keep_alive=CANARY_KEEPALIVE))
            reply = b""
            while len(reply) < 4:
                data = await stream.receive_some(4 - len(reply))
                if not data:
                    return f"closed after {reply!r}"
                reply += data
            await stream.send_all(encoders.encode_disconnect())
            return f"connack-{reply[3]}" if reply[:2] == b"\x20\x02" else f"not a CONNACK: {reply!r}"
        finally:
            await stream.aclose()

    async def _probe_and_report(self, n: int) -> None:
        began = trio.current_time()
        outcome = f"no CONNACK within {CANARY_LATENCY:g} s"
        try:
            with trio.move_on_after(CANARY_LATENCY):
                outcome = await self._probe_once()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            outcome = repr(exc)
        self.report.probes += 1
        if outcome != "connack-0":
            self.problem(f"probe {n}: {outcome}")
        else:
            self.latency(trio.current_time() - began)

    async def stop(self) -> None:
        """DISCONNECT the devices, give the subscriber a moment to hear it, then DISCONNECT it."""
        self.stopping = True
        subscriber, devices = (self.clients[:1], self.clients[1:]) if self.with_presence else ([], self.clients)
        for client in [*devices, None, *subscriber]:
            if client is None:
                await trio.sleep(0.3)  # the devices' offline events reach the subscriber meanwhile
                continue
            await client.send(encoders.encode_disconnect())
            async with client.sending:
                await client.stream.aclose()
