"""What an embedder trips over first (issue 34, items 7 and 9): arguments refused as
plain exceptions before any task starts, and listeners the engine takes over or never
gets handled as trio expects (MockClock)."""

from __future__ import annotations

import math
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
