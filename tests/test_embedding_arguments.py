"""What an embedder trips over first (issue 34, items 7 and 9): arguments refused as
plain exceptions before any task starts, and listeners the engine takes over or never
gets handled as trio expects (MockClock)."""

from __future__ import annotations

import math
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import MockClock

import idlekeeper
from idlekeeper import engine as engine_module
from idlekeeper.protocol import Protocol


@pytest.mark.parametrize(
    "options",
    [
        {"tick": 0},
        {"tick": -0.1},
        {"tick": math.nan},
        {"tick": math.inf},
        {"lookahead": -1.0},
        {"lookahead": math.nan},
        {"hook_timeout": 0},
        {"hook_threads": 0},
    ],
)
async def test_bad_keeper_arguments_are_a_plain_value_error(options: dict[str, Any]) -> None:
    # Not an ExceptionGroup[ValueError], which `except ValueError` misses: trio checks
    # its own arguments before it opens a nursery, and so does open_keeper.
    with pytest.raises(ValueError, match=next(iter(options))):
        async with idlekeeper.open_keeper(**options):
            pass  # pragma: no cover


async def test_a_task_blocked_in_accept_is_woken_when_the_engine_takes_the_listener(clock: MockClock) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    woken = trio.Event()

    async def accepting() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await listeners[0].accept()
        woken.set()

    keeping = idlekeeper.open_keeper()
    async with keeping as keeper, idlekeeper.open_engine(keeper) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(accepting)
        await trio.testing.wait_all_tasks_blocked()
        engine.serve(listeners, Protocol)
        with trio.fail_after(1):  # before, it stayed blocked on a descriptor the engine owned
            await woken.wait()


async def test_listeners_of_a_start_that_fails_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[trio.SocketListener] = []
    real_open = trio.open_tcp_listeners

    async def recording(*args: Any, **kwargs: Any) -> list[trio.SocketListener]:
        listeners = await real_open(*args, **kwargs)
        opened.extend(listeners)
        return listeners

    @asynccontextmanager
    async def broken(keeper: idlekeeper.Keeper, **_: Any) -> AsyncIterator[Any]:
        raise RuntimeError("the engine could not start")
        yield  # pragma: no cover

    monkeypatch.setattr(trio, "open_tcp_listeners", recording)
    monkeypatch.setattr(engine_module, "open_engine", broken)
    async with idlekeeper.open_keeper() as keeper, trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="could not start"):
            await nursery.start(
                lambda task_status: idlekeeper.serve_protocol(
                    Protocol, 0, keeper=keeper, host="127.0.0.1", task_status=task_status
                )
            )
    assert opened and all(listener.socket.fileno() == -1 for listener in opened)


class _Plain(trio.abc.Stream):
    """A stream with no half-close, as an SSLStream has none."""

    def __init__(self) -> None:
        self.sent = b""
        self.closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += bytes(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return b""

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()


async def test_a_watched_stream_is_half_closeable_only_when_its_stream_is(clock: MockClock) -> None:
    # Issue 34, item 5: it always claimed to be, so StapledStream(conn, conn).send_eof()
    # called a send_eof that raised TypeError instead of closing the send side.
    plain = _Plain()
    a, b = trio.testing.memory_stream_pair()
    async with idlekeeper.open_keeper() as keeper:
        with keeper.watch(plain, idle=5) as conn, keeper.watch(a, idle=5) as halves:
            assert isinstance(conn, idlekeeper.WatchedStream)
            assert not isinstance(conn, trio.abc.HalfCloseableStream)
            assert isinstance(halves, idlekeeper.HalfCloseableWatchedStream)
            await trio.StapledStream(conn, conn).send_eof()  # no half-close: closes the send side
            assert plain.closed
            await halves.send_eof()
            assert await b.receive_some(10) == b""


_OFF_LINUX = """
import select, socket, sys
import trio  # trio picks its own I/O backend first; the names go after
for name in [n for n in dir(select) if n.lower().startswith("epoll")]:
    delattr(select, name)
for name in ("CMSG_SPACE", "CMSG_LEN"):
    if hasattr(socket, name):
        delattr(socket, name)
sys.modules["fcntl"] = None
sys.modules["termios"] = None
import idlekeeper
assert callable(idlekeeper.open_keeper) and callable(idlekeeper.serve_tcp)
try:
    idlekeeper.open_engine
except ImportError as exc:
    print("engine:", exc)
else:
    raise SystemExit("the engine imported without epoll")
"""


def test_the_package_imports_without_linux_only_names() -> None:
    # Issue 34, item 3: `import idlekeeper` failed off Linux (select.EPOLLIN on macOS,
    # socket.CMSG_SPACE on Windows); only the dense engine needs them, and says so.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OFF_LINUX], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "dense engine" in done.stdout and "needs Linux" in done.stdout


async def test_a_closed_keeper_or_engine_refuses_as_a_closed_trio_resource(clock: MockClock) -> None:
    # Issue 34, items 2 and 8: a RuntimeError, where trio's resources raise ClosedResourceError.
    async with idlekeeper.open_keeper() as keeper:
        async with idlekeeper.open_engine(keeper) as engine:
            pass
        a, _ = socket.socketpair()
        with a, pytest.raises(trio.ClosedResourceError, match="engine is closed"):
            engine.adopt(a, Protocol())
    with pytest.raises(trio.ClosedResourceError, match="keeper is closed"):
        keeper.watch(idle=1)


async def test_serve_protocol_takes_the_engines_options(clock: MockClock) -> None:
    # Issue 34, item 8: it could not pass them, so a dense server that wanted coalescing
    # or a smaller read had to assemble open_engine and serve itself.
    async with idlekeeper.open_keeper() as keeper, trio.open_nursery() as nursery:
        engine: idlekeeper.Engine = await nursery.start(
            lambda task_status: idlekeeper.serve_protocol(
                Protocol,
                0,
                keeper=keeper,
                host="127.0.0.1",
                read_size=4096,
                max_events=64,
                accept_batch=8,
                high_water=8192,
                low_water=1024,
                coalesce=0.05,
                coalesce_canned=0.2,
                task_status=task_status,
            )
        )
        got = (engine.read_size, engine.max_events, engine.accept_batch, engine.high_water, engine.low_water)
        assert got == (4096, 64, 8, 8192, 1024) and (engine.coalesce, engine.coalesce_canned) == (0.05, 0.2)
        with pytest.raises(ValueError, match="low_water"):
            await nursery.start(
                lambda task_status: idlekeeper.serve_protocol(
                    Protocol, 0, keeper=keeper, host="127.0.0.1", low_water=10, high_water=5, task_status=task_status
                )
            )
        nursery.cancel_scope.cancel()
