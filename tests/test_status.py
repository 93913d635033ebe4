"""The status endpoint (an app on servers.http) and the Prometheus collectors, over real
sockets under MockClock."""

from __future__ import annotations

from functools import partial

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from trio.testing import MockClock

import idlekeeper
from servers.prometheus import CONTENT_TYPE, Families, LiveCollector, render, worker_registry
from servers.status import serve_status


class Source:
    def __init__(self) -> None:
        self.ok = True

    def healthy(self) -> bool:
        return self.ok

    def metrics(self) -> bytes:
        return b"# TYPE up gauge\nup 1\n"

    def lookup(self, kind: str, key: str, local: bool = False) -> object | None:
        return {"id": key} if kind == "devices" and key == "dev 1" else None


async def request(port: int, raw: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(raw)
    out = b""
    with trio.move_on_after(30):
        while chunk := await stream.receive_some():
            out += chunk
    return out


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_families_keep_exposed_names_and_escape_labels() -> None:
    f = Families({"worker": "0"})
    f.counter("hits_total", "Hits.", 3)
    f.gauge("temp", "Temperature.", 21.5)
    f.counter_by("ended_total", "Ended.", "path", {'/a"b': 1, "/c\n}": 2})
    f.histogram("lag_seconds", "Lag.", [(0.1, 1), (float("inf"), 2)], 0.35)
    registry = CollectorRegistry()
    registry.register(LiveCollector(lambda: f.families))
    got = _samples(render(registry))
    w = ("worker", "0")
    assert got[("hits_total", (w,))] == 3
    assert got[("temp", (w,))] == 21.5
    assert got[("ended_total", (("path", '/a"b'), w))] == 1
    assert got[("ended_total", (("path", "/c\n}"), w))] == 2
    assert got[("lag_seconds_bucket", (("le", "0.1"), w))] == 1
    assert got[("lag_seconds_bucket", (("le", "+Inf"), w))] == 2
    assert got[("lag_seconds_count", (w,))] == 2 and got[("lag_seconds_sum", (w,))] == 0.35


async def test_keeper_and_process_metrics(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(idle=1):
        await trio.sleep(2)
    got = _samples(render(worker_registry(keeper.stats, {"worker": "0"})))
    w = ("worker", "0")
    assert got[("idlekeeper_expired_total", (("reason", "idle"), w))] == 1
    assert got[("idlekeeper_expired_total", (("reason", "send"), w))] == 0
    assert got[("idlekeeper_reaper_lag_seconds_bucket", (("le", "+Inf"), w))] == 1
    assert got[("idlekeeper_watched", (w,))] == 0
    # The process collector's figures (the worker's own endpoint says whose they are).
    assert got[("process_open_fds", ())] > 0
    assert got[("process_resident_memory_bytes", ())] > 1_000_000


async def test_routes(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    source = Source()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, source, 0, keeper=keeper))
        ok = await request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"ok\n")
        head = await request(port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")  # the head alone
        source.ok = False
        sick = await request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sick.startswith(b"HTTP/1.1 503")
        metrics = await request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert CONTENT_TYPE.encode() in metrics and b"\nup 1\n" in metrics
        two = await request(
            port,
            b"GET /devices/dev%201 HTTP/1.1\r\nHost: x\r\n\r\nGET /devices/nobody HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\n\r\n",
        )
        first, second = two.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200") and b'{"id": "dev 1"}' in first
        assert second.startswith(b"404")
        post = await request(
            port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        assert post.startswith(b"HTTP/1.1 405") and b"\r\nallow: GET, HEAD\r\n" in post
        bad = await request(port, b"NOT HTTP AT ALL\r\n\r\n")
        assert bad.startswith(b"HTTP/1.1 400")
        huge = await request(port, b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 30000 + b"\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 431")
        nursery.cancel_scope.cancel()


async def test_slow_head_and_idle_connections_are_cut(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, Source(), 0, keeper=keeper))
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        assert await idle.receive_some() == b""
        assert 10 <= trio.current_time() - start < 10 + keeper.tick
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()

        async def trickle() -> None:
            try:
                for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
                    await slow.send_all(bytes([byte]))
                    await trio.sleep(1)  # trickled: idle never fires, the head deadline does
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        nursery.start_soon(trickle)
        answer = await slow.receive_some()
        assert answer.startswith(b"HTTP/1.1 408")
        assert 10 <= trio.current_time() - start < 10 + keeper.tick
        nursery.cancel_scope.cancel()
