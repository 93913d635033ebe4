"""servers.echo in-process under MockClock, with raw-socket clients; and the demo end to end."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from servers import echo


def events(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_line_buffer_splits_and_limits() -> None:
    buf = echo.LineBuffer(max_line=8)
    assert list(buf.feed(b"PI")) == []
    assert buf.partial
    assert list(buf.feed(b"NG\r\nA\nB")) == [b"PING", b"A"]
    assert buf.partial
    with pytest.raises(echo.LineTooLong):
        list(buf.feed(b"123456789"))


async def start_server(nursery: trio.Nursery, *extra: str) -> int:
    args = echo.parser().parse_args(["--port", "0", "--idle", "3", "--line-timeout", "5", *extra])
    port: int = await nursery.start(echo.serve, args)
    return port


async def test_ping_slowloris_and_slow_reader(clock: MockClock, capsys: pytest.CaptureFixture[str]) -> None:
    loris_closed: list[float] = []
    async with trio.open_nursery() as nursery:
        port = await start_server(nursery)
        healthy = await trio.open_tcp_stream("127.0.0.1", port)
        loris = await trio.open_tcp_stream("127.0.0.1", port)
        reader = await trio.open_tcp_stream("127.0.0.1", port)
        await reader.send_all(b"BLOB 100000000\n")  # and never reads
        began = trio.current_time()

        async def trickle() -> None:
            try:
                while True:  # a byte a second, never a newline: idle never fires
                    await loris.send_all(b"x")
                    await trio.sleep(1)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async def see_close() -> None:
            # Closed with a trickled byte unread, the server's close is a reset: also a close.
            with contextlib.suppress(trio.BrokenResourceError):
                assert await loris.receive_some() == b""
            loris_closed.append(trio.current_time() - began)

        nursery.start_soon(trickle)
        nursery.start_soon(see_close)
        for _ in range(8):
            await healthy.send_all(b"PING\n")
            assert await healthy.receive_some() == b"PONG\n"  # unaffected throughout
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert len(loris_closed) == 1
    assert 5 <= loris_closed[0] < 5 + 0.05  # the line deadline, at most one tick late
    log = events(capsys.readouterr().out)
    expired = {e["reason"] for e in log if e["event"] == "expired"}
    assert expired == {"absolute", "send"}
    lags = [float(str(e["lag_ms"])) for e in log if e["event"] == "expired"]
    assert all(0 <= lag < 50 for lag in lags)


async def test_overlong_line_gets_a_clear_error(clock: MockClock, capsys: pytest.CaptureFixture[str]) -> None:
    async with trio.open_nursery() as nursery:
        port = await start_server(nursery)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"x" * (echo.MAX_LINE + 10))
        reply = b""
        while chunk := await client.receive_some():
            reply += chunk
        assert reply.startswith(b"ERR line longer than")
        other = await trio.open_tcp_stream("127.0.0.1", port)
        await other.send_all(b"hello\n")
        assert await other.receive_some() == b"hello\n"
        nursery.cancel_scope.cancel()
    assert any(e.get("reason") == "line-too-long" for e in events(capsys.readouterr().out))


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    """The main job, small: a separate server process, real time, real clients."""
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.echo_demo", "--clients", "80", "--duration", "7", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["false_expiries"] == 0
    for row in result["rows"]:
        if row["expected"]:
            assert row["closed"] == row["right_reason"] == row["clients"] > 0
        if "lateness_ms" in row:
            assert row["lateness_ms"]["min"] >= 0  # never early, even seen from the client
