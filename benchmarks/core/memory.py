"""Part 3 of the core benchmark (:mod:`benchmarks.core`): bytes per watched connection,
measured with tracemalloc against the same tasks unwatched.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

import trio

import idlekeeper
from benchmarks.core.null_stream import NullStream
from idlekeeper.watch import Watch, WatchedStream

__all__ = ["bytes_per_connection"]


def bytes_per_connection(conns: int) -> dict[str, Any]:
    """Traced bytes per task with and without a watch around it, over ``conns`` tasks,
    and the size of each object a watch is made of."""

    async def measure(watched: bool) -> int:
        async with idlekeeper.open_keeper() as keeper, trio.open_nursery() as nursery:
            null = NullStream()
            ready = trio.Event()
            count = 0

            async def connection() -> None:
                nonlocal count
                if watched:
                    with keeper.watch(null, idle=600, receive=300):
                        count += 1
                        if count == conns:
                            ready.set()
                        await trio.sleep_forever()
                else:
                    count += 1
                    if count == conns:
                        ready.set()
                    await trio.sleep_forever()

            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(conns):
                nursery.start_soon(connection)
            await ready.wait()
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
            nursery.cancel_scope.cancel()
            return used

    tracemalloc.start()
    try:
        plain = trio.run(measure, False)
        watched = trio.run(measure, True)
    finally:
        tracemalloc.stop()
    probe = Watch.__new__(Watch)
    return {
        "connections": conns,
        "task_only_bytes": plain / conns,
        "task_with_watch_bytes": watched / conns,
        "watch_bytes": (watched - plain) / conns,
        "sizeof": {
            "Watch": sys.getsizeof(probe),
            "CancelScope": sys.getsizeof(trio.CancelScope()),
            "WatchedStream": sys.getsizeof(WatchedStream.__new__(WatchedStream)),
        },
    }
