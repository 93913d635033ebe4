"""The clients of ``python -m benchmarks.topics``: one holding many wildcard filters, one
publishing at a steady rate, healthy devices pinging, and a newcomer connecting now and
then; each a raw MQTT 3.1.1 client on a trio stream, all in one trio run (no threads, so
the round trips measured are not the load tester's lock contention).

Every loop here is bounded in time; sockets are loopback only.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from loadtest.mqtt_frames import frames
from servers.heartbeat.mqtt import encoders

__all__ = ["Client", "Devices", "Window", "hold_filters", "percentile", "publish_window"]

_PINGREQ = encoders.encode_pingreq()
_CONNACK, _PUBLISH, _SUBACK, _PINGRESP = 0x20, 0x30, 0x90, 0xD0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Client:
    """A raw MQTT client: bytes out, whole packets (first byte, body) in."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self._ready: list[tuple[int, bytes]] = []

    @classmethod
    async def connect(cls, port: int, client_id: str, keep_alive: int = 60) -> Client:
        """Open a connection and complete CONNECT; raises if the CONNACK is not a success."""
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.send(encoders.encode_connect(client_id, keep_alive=keep_alive))
        first, body = await client.packet()
        if first != _CONNACK or body[1:2] != b"\x00":
            await client.stream.aclose()
            raise ConnectionError(f"{client_id}: no successful CONNACK ({first:#x} {body.hex()})")
        return client

    async def send(self, data: bytes) -> None:
        """Write ``data`` whole."""
        await self.stream.send_all(data)

    async def packet(self) -> tuple[int, bytes]:
        """The next packet the server sent; ConnectionError if it closed."""
        while not self._ready:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self._buf += chunk
            found, used = frames(self._buf)
            self._ready = [(first, bytes(self._buf[start:end])) for first, start, end in found]
            del self._buf[:used]
        return self._ready.pop(0)

    async def close(self) -> None:
        """Say DISCONNECT (if the link still takes it) and close."""
        with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.send(encoders.encode_disconnect())
        await self.stream.aclose()


async def hold_filters(client: Client, count: int, *, batch: int = 200) -> tuple[float, int]:
    """Subscribe ``client`` to ``zz/+/0`` .. ``zz/+/<count-1>``, one filter a SUBSCRIBE (as the
    issue's client did), ``batch`` packets in flight; the seconds until the last SUBACK and
    how many filters were refused (a SUBACK code 0x80)."""
    started = time.perf_counter()
    refused = 0
    for first in range(0, count, batch):
        ids = range(first, min(count, first + batch))
        await client.send(b"".join(encoders.encode_subscribe(1 + i % 65535, [(f"zz/+/{i}", 0)]) for i in ids))
        for _ in ids:
            kind, body = await client.packet()
            while kind != _SUBACK:  # nothing else is due yet, but a PUBLISH may come (MQTT-3.8.4)
                kind, body = await client.packet()
            refused += body[2:] == b"\x80"
    return time.perf_counter() - started, refused


@dataclass
class Devices:
    """Healthy devices, each sending a PINGREQ every ``every`` seconds and timing its PINGRESP;
    newcomers connecting once a second, timed to their CONNACK."""

    port: int
    count: int
    every: float
    rtts: list[float] = field(default_factory=list)
    """Round trips (seconds) since :meth:`take` was last called."""
    connects: list[float] = field(default_factory=list)
    """CONNECT-to-CONNACK times (seconds; inf for none within 15 s) since :meth:`take`."""

    def take(self) -> tuple[list[float], list[float]]:
        """The round trips and connect times so far, starting afresh."""
        taken = self.rtts, self.connects
        self.rtts, self.connects = [], []
        return taken

    async def run(self, stop: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect every device, then ping and probe until ``stop`` is set."""
        clients = [await Client.connect(self.port, f"healthy-{i}") for i in range(self.count)]
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(self._ping, client, stop)
            nursery.start_soon(self._newcomers, stop)
            task_status.started()
            await stop.wait()
            nursery.cancel_scope.cancel()
        for client in clients:
            await client.close()

    async def _ping(self, client: Client, stop: trio.Event) -> None:
        await trio.sleep(random.uniform(0, self.every))  # spread the devices over the period
        while not stop.is_set():
            due = trio.current_time() + self.every
            started = time.perf_counter()
            await client.send(_PINGREQ)
            while (await client.packet())[0] != _PINGRESP:
                pass
            self.rtts.append(time.perf_counter() - started)
            await trio.sleep_until(due)

    async def _newcomers(self, stop: trio.Event) -> None:
        number = 0
        while not stop.is_set():
            due = trio.current_time() + 1.0
            number += 1
            started = time.perf_counter()
            took = math.inf
            with trio.move_on_after(15):
                try:
                    client = await Client.connect(self.port, f"newcomer-{number}")
                    took = time.perf_counter() - started
                    await client.close()
                except (ConnectionError, OSError, trio.BrokenResourceError):
                    pass
            self.connects.append(took)
            await trio.sleep_until(due)


@dataclass
class Window:
    """What one measuring window saw."""

    seconds: float
    """From its start until the server had read every publish (the last sentinel answered)."""
    published: int
    cpu: float
    """The server's CPU seconds over ``seconds``."""
    drained: bool
    """Every publish was read within the drain bound."""
    rtts: list[float]
    connects: list[float]
    delivered: int
    """Messages the filter holder received."""


async def publish_window(
    publisher: Client | None,
    topic: str,
    rate: float,
    seconds: float,
    devices: Devices,
    cpu: Callable[[], float],
    delivered: Callable[[], int],
    *,
    drain: float = 30.0,
) -> Window:
    """Publish QoS 0 on ``topic`` at ``rate`` a second for ``seconds`` (none without a
    ``publisher``: a quiet window), while ``devices`` ping.

    A PINGREQ follows every twentieth of a second's publishes: a server that falls behind
    by more than half a second of them is sent no more until it catches up, so an
    overloaded server's backlog stays bounded (the rate it reached is in the result).
    At the end, waits up to ``drain`` seconds for the last one's PINGRESP."""
    devices.take()
    cpu0, got0, started = cpu(), delivered(), time.perf_counter()
    published = 0
    drained = True
    if publisher is not None:
        published, drained = await _publish(publisher, topic, rate, seconds, drain)
    else:
        await trio.sleep(seconds)
    elapsed = time.perf_counter() - started
    used = cpu() - cpu0
    rtts, connects = devices.take()
    return Window(elapsed, published, used, drained, rtts, connects, delivered() - got0)


async def _publish(client: Client, topic: str, rate: float, seconds: float, drain: float) -> tuple[int, bool]:
    packet = encoders.encode_publish(topic, b"0123456789abcdef", qos=0)
    every = max(1, round(rate / 20))  # publishes between sentinels
    sent = answered = sentinels = 0
    finished = False
    caught_up = trio.Event()

    async def count_answers() -> None:
        nonlocal answered
        while True:
            if (await client.packet())[0] == _PINGRESP:
                answered += 1
                if finished and answered == sentinels:
                    caught_up.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_answers)
        start = trio.current_time()
        end = start + seconds
        while (now := trio.current_time()) < end:
            due = min(int((now - start) * rate), int(seconds * rate)) - sent
            if due > 0 and sentinels - answered <= 10:
                out = []
                for _ in range(due):
                    out.append(packet)
                    sent += 1
                    if sent % every == 0:
                        out.append(_PINGREQ)
                        sentinels += 1
                await client.send(b"".join(out))
            await trio.sleep(0.005)
        sentinels += 1
        finished = True
        await client.send(_PINGREQ)
        if answered == sentinels:  # it was answered while the send was still returning
            caught_up.set()
        with trio.move_on_after(drain):
            await caught_up.wait()
        nursery.cancel_scope.cancel()
    return sent, caught_up.is_set()
