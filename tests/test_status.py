"""The status endpoint (an app on servers.http) and the Prometheus collectors, over real
sockets under MockClock."""

from __future__ import annotations

import logging
import socket
from functools import partial
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from trio.testing import MockClock

import idlekeeper
from servers.bearer import TokenFile, TokenFileError
from servers.heartbeat.__main__ import main as heartbeat_main
from servers.prometheus import CONTENT_TYPE, Families, LiveCollector, render, worker_registry
from servers.status import STATUS_CONFIG, serve_status


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
    # A few seconds, not a public server's: a probe or scraper sends its request at once.
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, Source(), 0, keeper=keeper))
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        assert await idle.receive_some() == b""
        assert 5 <= trio.current_time() - start < 5 + keeper.tick
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
        assert 5 <= trio.current_time() - start < 5 + keeper.tick
        nursery.cancel_scope.cancel()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def test_healthz_answers_however_many_idle_connections_are_held(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    keep_alive = STATUS_CONFIG.keep_alive_timeout
    held: dict[socket.socket, float] = {}

    def hold() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        held[sock] = trio.current_time()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, Source(), 0, keeper=keeper))
        for _ in range(STATUS_CONFIG.max_connections):
            hold()
        try:
            for _ in range(int(3 * keep_alive)):
                await trio.sleep(1)
                now = trio.current_time()
                for sock, opened in list(held.items()):
                    if _closed(sock):  # made room for a probe, or idle too long: hold another
                        del held[sock]
                        sock.close()
                        hold()
                    else:
                        assert now - opened < keep_alive + 1  # the idle limit holds each of them
                start = trio.current_time()
                answer = await request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok\n")
                assert trio.current_time() - start < keeper.tick
        finally:
            for sock in held:
                sock.close()
        nursery.cancel_scope.cancel()


def _get(path: str, *headers: str) -> bytes:
    lines = "".join(f"{h}\r\n" for h in headers)
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{lines}Connection: close\r\n\r\n".encode()


async def test_bearer_tokens_guard_all_but_healthz(keeper: idlekeeper.Keeper, clock: MockClock, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# scrapers\nscrape-Token_1.x~+/==  # prometheus\n\r\n  second-token \n")
    tokens = TokenFile.load(path)
    assert len(tokens) == 2
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_status, Source(), 0, keeper=keeper, tokens=tokens))
        open_ = await request(port, _get("/healthz"))
        assert open_.startswith(b"HTTP/1.1 200") and open_.endswith(b"ok\n")
        for route in ("/metrics", "/devices/dev%201", "/devices/nobody", "/nothing"):
            missing = await request(port, _get(route))
            assert missing.startswith(b"HTTP/1.1 401")
            assert b'\r\nwww-authenticate: Bearer realm="status"\r\n' in missing
            for wrong in ("Bearer scrape-Token_1", "Bearer second-tokenx", "Basic c2Vjb25kLXRva2Vu", "Bearer"):
                refused = await request(port, _get(route, f"Authorization: {wrong}"))
                assert refused.startswith(b"HTTP/1.1 401")
                assert b'www-authenticate: Bearer realm="status", error="invalid_token"' in refused
        metrics = await request(port, _get("/metrics", "Authorization: Bearer scrape-Token_1.x~+/=="))
        assert metrics.startswith(b"HTTP/1.1 200") and b"\nup 1\n" in metrics
        device = await request(port, _get("/devices/dev%201", "authorization: bearer second-token"))
        assert device.startswith(b"HTTP/1.1 200") and b'{"id": "dev 1"}' in device
        post = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        assert (await request(port, post)).startswith(b"HTTP/1.1 401")  # nothing told before the token
        authorized_post = post.replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer second-token\r\n")
        assert (await request(port, authorized_post)).startswith(b"HTTP/1.1 405")

        path.write_text("third-token\n")
        assert tokens.reload()
        old = await request(port, _get("/metrics", "Authorization: Bearer second-token"))
        assert old.startswith(b"HTTP/1.1 401")
        new = await request(port, _get("/metrics", "Authorization: Bearer third-token"))
        assert new.startswith(b"HTTP/1.1 200")
        nursery.cancel_scope.cancel()


def test_token_file_errors_name_the_line_never_the_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text("good-token\n")
    tokens = TokenFile.load(path)
    path.write_text("good-token\nsecret with spaces\n")
    with pytest.raises(TokenFileError, match=r"tokens:2: not a bearer token") as raised:
        TokenFile.load(path)
    assert "secret" not in str(raised.value)
    with caplog.at_level(logging.DEBUG, logger="servers.status"):
        assert not tokens.reload()  # the tokens in force stay
    assert "not reloaded" in caplog.text and "secret" not in caplog.text
    assert tokens.allows("Bearer good-token")
    path.write_text("# nothing but comments\n\n")
    with pytest.raises(TokenFileError, match="no tokens"):
        TokenFile.load(path)
    with pytest.raises(TokenFileError, match="cannot read"):
        TokenFile.load(tmp_path / "absent")
    path.write_bytes(b"\xff\xfe\n")
    with pytest.raises(TokenFileError, match="not UTF-8"):
        TokenFile.load(path)
    assert not tokens.allows(None) and not tokens.allows("good-token") and not tokens.allows("Bearer  ")


def test_the_command_line_refuses_a_token_file_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens"
    path.write_text("secret with spaces\n")
    for argv, told in (
        (["--status-port", "0", "--status-token-file", str(path)], "tokens:1: not a bearer token"),
        (["--status-token-file", str(path)], "--status-token-file: needs --status-port"),
    ):
        with pytest.raises(SystemExit) as exited:
            heartbeat_main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert told in err and "secret" not in err
