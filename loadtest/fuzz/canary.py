"""The canary of ``python -m loadtest fuzz``: well-behaved clients beside the fuzzer, in a
process of their own, so that the fuzzer's load never starves them.

    python -m loadtest.fuzz.canary --protocol mqtt|http|ws|mqtt-ws --port P --tag T [--no-presence]

It connects, prints one JSON line (``{"ready": true}``) on stdout, keeps its clients
busy until its stdin is closed, then stops them cleanly and prints its
:class:`~.observation.CanaryReport` as one JSON line, with ``peers``: every address its
connections had (the judge leaves them out of the fuzz connections' accounting).

- MQTT (:class:`MqttCanary`): :data:`CANARY_DEVICES` devices pinging every
  :data:`CANARY_INTERVAL` s with keep-alive :data:`CANARY_KEEPALIVE`, a subscriber to
  their presence topics that must hear them come online and never go offline, and a
  new connection every :data:`PROBE_INTERVAL` s that must get CONNACK 0. With
  ``--no-presence`` (a peer that publishes no presence, Mosquitto) no subscriber.
  ``mqtt-ws``: the same clients over WebSockets (:data:`MQTT_WS_PATH`), every one of them.
- HTTP (:class:`HttpCanary`): one keep-alive connection alternating ``GET /healthz``
  and ``POST /echo``, each 200 with the right body, and a new connection every
  :data:`PROBE_INTERVAL` s that must get 200.
- WebSocket (:class:`WsCanary`): one WebSocket to the echo app, sending text and
  binary messages in turn, each echoed intact, answering the server's pings; and a new
  WebSocket every :data:`PROBE_INTERVAL` s whose message is echoed and whose close is
  answered with 1000.

A reply slower than :data:`CANARY_LATENCY` is a problem. So is a pause of the canary
itself as long as the server's keep-alive window: its own silence could then explain
a drop, and its verdict would be void.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable, Sequence

import trio

from servers.heartbeat import encoders
from servers.heartbeat.policy import DEFAULT_PRESENCE_PREFIX

from ..mqtt_frames import frames
from .connection import peer_name
from .observation import CanaryReport
from .ws_stream import WsClientStream

__all__ = ["HttpCanary", "MqttCanary", "WsCanary", "main"]


CANARY_DEVICES = 3
CANARY_KEEPALIVE = 2
"""The canary's keep-alive (s): within the server's ``--max-keepalive`` cap, so it is
held to the same 3 s window as every fuzz connection."""
CANARY_INTERVAL = 0.5
CANARY_LATENCY = 5.0
"""A reply slower than this is a canary problem (the server stalled)."""
PROBE_INTERVAL = 1.0
MAX_PROBLEMS = 20
HTTP_KEEPALIVE_TIMEOUT = 2.0
"""The HTTP server's ``--keep-alive-timeout`` in a fuzz run (:data:`~.targets.HTTP_SERVER_ARGS`)."""
WS_PING_INTERVAL = 1.0
WS_PING_TIMEOUT = 1.0
"""The HTTP server's ``--ws-ping-interval`` and ``--ws-ping-timeout`` in a fuzz run
(:data:`~.targets.WS_SERVER_ARGS`): a WebSocket silent that long is closed."""
MQTT_WS_PATH = "/mqtt"
"""Where the heartbeat server's WebSocket listener serves MQTT (its default ``--ws-path``)."""


class _Canary:
    def __init__(self, port: int, tag: str, kind: str) -> None:
        self.port = port
        self.tag = tag
        self.report = CanaryReport(kind)
        self.peers: set[str] = set()
        self.stopping = False
        self.began = trio.current_time()

    def problem(self, text: str) -> None:
        """Note a problem, with when it happened (seconds since the canary started)."""
        self.report.problem_count += 1
        if len(self.report.problems) < MAX_PROBLEMS:
            self.report.problems.append(f"{text} (at {trio.current_time() - self.began:.0f} s)")

    def gap(self, seconds: float, limit: float) -> None:
        """The canary's own loop was away ``seconds``; at ``limit`` its verdict is void."""
        if seconds > self.report.max_gap:
            self.report.max_gap = seconds
            if seconds >= limit:
                self.problem(f"the canary itself was starved for {seconds:.1f} s, its check is void")

    async def open(self) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        self.peers.add(peer_name(stream.socket))
        return stream

    async def open_ws(self, path: str, subprotocols: Sequence[str] = ()) -> WsClientStream:
        """A WebSocket (its handshake done) to ``path`` on the server's port."""
        stream = await WsClientStream.connect(self.port, path, subprotocols)
        self.peers.add(peer_name(stream.socket))
        return stream

    def latency(self, seconds: float) -> None:
        self.report.max_latency = max(self.report.max_latency, seconds)
        if seconds > CANARY_LATENCY:
            self.problem(f"a reply took {seconds:.1f} s")

    async def _probe(self) -> None:
        """A new connection every :data:`PROBE_INTERVAL` s until the canary stops."""
        n = 0
        while not self.stopping:
            await trio.sleep(PROBE_INTERVAL)
            n += 1
            await self._probe_and_report(n)

    async def _probe_and_report(self, n: int) -> None:
        """Open probe ``n``; count it and note any problem with it."""
        raise NotImplementedError

    async def _checked(self, n: int, probe: Callable[[], Awaitable[str]]) -> None:
        """Run probe ``n`` within :data:`CANARY_LATENCY`: counted if it ran, a problem if it
        failed or says one (it says nothing when all went well)."""
        try:
            with trio.fail_after(CANARY_LATENCY):
                said = await probe()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.problem(f"probe {n}: {exc!r}")
            return
        self.report.probes += 1
        if said:
            self.problem(f"probe {n}: {said}")


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


class MqttCanary(_Canary):
    """Well-behaved MQTT clients beside the fuzzer: :data:`CANARY_DEVICES` devices pinging
    every :data:`CANARY_INTERVAL` s with keep-alive :data:`CANARY_KEEPALIVE`, a subscriber
    to their presence topics that must hear them come online and never go offline, and a
    new connection every :data:`PROBE_INTERVAL` s that must be accepted."""

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


class HttpCanary(_Canary):
    """A well-behaved HTTP client beside the fuzzer: on one keep-alive connection,
    ``GET /healthz`` and ``POST /echo`` in turn, each of which must be 200 (the echo
    intact), and a new connection every :data:`PROBE_INTERVAL` s that must get 200."""

    def __init__(self, port: int, tag: str) -> None:
        super().__init__(port, tag, "http")

    async def _exchange(self, stream: trio.abc.Stream, request: bytes, buf: bytearray) -> tuple[int, bytes]:
        await stream.send_all(request)
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end >= 0:
                head = bytes(buf[:head_end]).lower()
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if len(buf) >= head_end + 4 + length:
                    status = int(head.split(b" ", 2)[1])
                    body = bytes(buf[head_end + 4 : head_end + 4 + length])
                    del buf[: head_end + 4 + length]
                    return status, body
            data = await stream.receive_some(65536)
            if not data:
                raise trio.BrokenResourceError("closed by the server")
            buf += data

    async def start(self, nursery: trio.Nursery) -> None:
        """Open the keep-alive connection and return once a first request on it was answered
        (the server holds it by then); then the requests go on, with the probes."""
        self.report.clients = 1
        stream = await self.open()
        buf = bytearray()
        with trio.fail_after(CANARY_LATENCY):
            status, _ = await self._exchange(stream, b"GET /healthz HTTP/1.1\r\nHost: canary\r\n\r\n", buf)
        if status != 200:
            raise RuntimeError(f"the canary's first request got {status}")
        nursery.start_soon(self._run, stream, buf)
        nursery.start_soon(self._probe)

    async def _run(self, stream: trio.abc.Stream, buf: bytearray) -> None:
        n = 0
        while not self.stopping:
            n += 1
            body = f"canary-{self.tag}-{n}".encode()
            if n % 2:
                request, expect = b"GET /healthz HTTP/1.1\r\nHost: canary\r\n\r\n", b"ok\n"
            else:
                request = b"POST /echo HTTP/1.1\r\nHost: canary\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                expect = body
            began = trio.current_time()
            try:
                with trio.fail_after(CANARY_LATENCY):
                    status, got = await self._exchange(stream, request, buf)
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as exc:
                if self.stopping:
                    return
                self.problem(f"request {n}: {exc!r}; connecting again")
                await stream.aclose()
                stream = await self.open()
                buf.clear()
                continue
            self.latency(trio.current_time() - began)
            if status != 200 or got != expect:
                self.problem(f"request {n}: status {status}, body {got[:40]!r}")
            else:
                self.report.exchanges += 1
            before = trio.current_time()
            await trio.sleep(0.05)
            # Silent as long as the server's keep-alive timeout: a close would be ours.
            self.gap(trio.current_time() - before, HTTP_KEEPALIVE_TIMEOUT)
        await stream.aclose()

    async def _probe_and_report(self, n: int) -> None:
        async def probe() -> str:
            stream = await self.open()
            try:
                request = b"GET / HTTP/1.1\r\nHost: canary\r\nConnection: close\r\n\r\n"
                status, _ = await self._exchange(stream, request, bytearray())
            finally:
                await stream.aclose()
            return "" if status == 200 else f"status {status}"

        await self._checked(n, probe)

    async def stop(self) -> None:
        """Stop after the request in flight."""
        self.stopping = True
        await trio.sleep(0.2)


class WsCanary(_Canary):
    """A well-behaved WebSocket client beside the fuzzer: on one WebSocket to the echo
    app, a text and a binary message in turn, each of which must come back intact,
    the server's pings answered as they come; and a new WebSocket every
    :data:`PROBE_INTERVAL` s whose message must come back and whose close (1000) must
    be answered."""

    def __init__(self, port: int, tag: str) -> None:
        super().__init__(port, tag, "ws")

    async def start(self, nursery: trio.Nursery) -> None:
        """Open the WebSocket and return once a first message came back on it; then the
        messages go on, with the probes."""
        self.report.clients = 1
        stream = await self.open_ws("/canary")
        with trio.fail_after(CANARY_LATENCY):
            await stream.send_message("hello")
            if await stream.receive_message() != "hello":
                raise RuntimeError("the canary's first message did not come back")
        echoes_in, echoes = trio.open_memory_channel[str | bytes | None](16)
        nursery.start_soon(self._read, stream, echoes_in)
        nursery.start_soon(self._run, stream, echoes)
        nursery.start_soon(self._probe)

    async def _read(self, stream: WsClientStream, echoes: trio.MemorySendChannel[str | bytes | None]) -> None:
        # Reading all the time: a ping is answered at once, whatever the writer waits for.
        while True:
            try:
                message = await stream.receive_message()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                message = None
            await echoes.send(message)
            if message is None:
                return

    async def _run(self, stream: WsClientStream, echoes: trio.MemoryReceiveChannel[str | bytes | None]) -> None:
        n = 0
        while not self.stopping:
            n += 1
            message: str | bytes = f"canary-{self.tag}-{n} é" if n % 2 else bytes(range(256)) * (n % 7)
            began = trio.current_time()
            try:
                with trio.fail_after(CANARY_LATENCY):
                    await stream.send_message(message)
                    got = await echoes.receive()
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                got = repr(exc)
            if got is None and self.stopping:
                return
            if got != message:
                self.problem(f"message {n}: {got!r:.60} came back (close {stream.close_code})")
                return  # the WebSocket is gone or out of step: the problem is noted
            self.latency(trio.current_time() - began)
            self.report.exchanges += 1
            before = trio.current_time()
            await trio.sleep(0.05)
            # Away as long as the server's ping window: a close would be ours.
            self.gap(trio.current_time() - before, WS_PING_INTERVAL + WS_PING_TIMEOUT)
        await stream.aclose()

    async def _probe_and_report(self, n: int) -> None:
        async def probe() -> str:
            stream = await self.open_ws(f"/probe/{n}")
            try:
                await stream.send_message(f"probe {n}")
                got = await stream.receive_message()
                await stream.close_handshake()
            finally:
                await stream.aclose()
            if got != f"probe {n}" or stream.close_code != 1000:
                return f"{got!r:.40} came back, close {stream.close_code}"
            return ""

        await self._checked(n, probe)

    async def stop(self) -> None:
        """Stop after the message in flight."""
        self.stopping = True
        await trio.sleep(0.2)


async def serve(protocol: str, port: int, tag: str, presence: bool = True) -> None:
    """Run the canary until stdin closes; print the ready line, then the report."""
    canary: MqttCanary | HttpCanary | WsCanary
    if protocol in ("mqtt", "mqtt-ws"):
        canary = MqttCanary(port, tag, presence, MQTT_WS_PATH if protocol == "mqtt-ws" else None)
    else:
        canary = HttpCanary(port, tag) if protocol == "http" else WsCanary(port, tag)
    async with trio.open_nursery() as nursery:
        await canary.start(nursery)
        print(json.dumps({"ready": True}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the fuzzer closes our stdin
        await canary.stop()
        nursery.cancel_scope.cancel()
    report = dataclasses.asdict(canary.report)
    report["peers"] = sorted(canary.peers)
    print(json.dumps(report), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.fuzz.canary``."""
    p = argparse.ArgumentParser(prog="python -m loadtest.fuzz.canary", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=("mqtt", "http", "ws", "mqtt-ws"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tag", required=True, help="makes the canary's client ids unique to the run")
    p.add_argument("--no-presence", action="store_true", help="MQTT: the server publishes no presence (a peer)")
    args = p.parse_args(argv)
    trio.run(serve, args.protocol, args.port, args.tag, not args.no_presence)
    return 0


if __name__ == "__main__":
    sys.exit(main())
