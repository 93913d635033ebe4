"""The status endpoint (h11) and the Prometheus writer, over real sockets under MockClock."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from trio.testing import MockClock

import idlekeeper
from servers.prometheus import CONTENT_TYPE, MetricsWriter
from servers.status import serve_status


class Source:
    def __init__(self) -> None:
        self.ok = True

    def healthy(self) -> bool:
        return self.ok

    def metrics(self) -> str:
        w = MetricsWriter()
        w.gauge("up", "Up.", 1)
        return w.render()

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


def test_prometheus_text() -> None:
    w = MetricsWriter()
    w.counter("hits_total", "Hits.", 3, {"path": '/a"b'})
    w.gauge("temp", "Temperature.", 21.5)
    w.counter("hits_total", "Hits.", 4, {"path": "/c\n"})
    w.histogram("lag_seconds", "Lag.", [(0.1, 1), (float("inf"), 2)], 2, 0.35)
    assert w.render() == (
        "# HELP hits_total Hits.\n# TYPE hits_total counter\n"
        'hits_total{path="/a\\"b"} 3\nhits_total{path="/c\\n"} 4\n'
        "# HELP temp Temperature.\n# TYPE temp gauge\ntemp 21.5\n"
        "# HELP lag_seconds Lag.\n# TYPE lag_seconds histogram\n"
        'lag_seconds_bucket{le="0.1"} 1\nlag_seconds_bucket{le="+Inf"} 2\nlag_seconds_count 2\nlag_seconds_sum 0.35\n'
    )
    with pytest.raises(ValueError):
        w.gauge("bad name", "x", 1)
    with pytest.raises(ValueError):
        w.gauge("hits_total", "x", 1)  # already a counter


async def test_keeper_and_process_metrics(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    w = MetricsWriter()
    w.keeper_stats(keeper.stats, {"worker": "0"})
    w.process()
    text = w.render()
    assert 'idlekeeper_expired_total{worker="0",reason="idle"} 0' in text
    assert 'idlekeeper_reaper_lag_seconds_bucket{worker="0",le="+Inf"} 0' in text
    assert "process_open_fds " in text


async def test_routes(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    source = Source()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, source, 0, keeper=keeper))
        ok = await request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"ok\n")
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
        assert post.startswith(b"HTTP/1.1 405") and b"Allow: GET, HEAD" in post
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
        try:
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
                await slow.send_all(bytes([byte]))
                await trio.sleep(1)  # trickled: idle never fires, the head deadline does
        except trio.BrokenResourceError:
            pass
        assert trio.current_time() - start < 10 + 1 + keeper.tick
        nursery.cancel_scope.cancel()
