"""The workers' collector policy: survivors are frozen out of full collections, garbage is not."""

from __future__ import annotations

import gc
import weakref

import trio
import trio.testing

from servers.gcpolicy import freeze_long_lived


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


async def test_survivors_are_frozen_and_young_cycles_collected_first(clock: trio.testing.MockClock) -> None:
    gc.unfreeze()
    try:
        kept = [Node() for _ in range(100)]  # long-lived state, like connections
        a, b = Node(), Node()
        a.other, b.other = b, a  # a garbage cycle, younger than one interval
        gone = weakref.ref(a)
        del a, b
        async with trio.open_nursery() as nursery:
            nursery.start_soon(freeze_long_lived, 2.0)
            await trio.sleep(1.9)
            assert gc.get_freeze_count() == 0  # nothing before the first interval
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() >= len(kept)
        assert gone() is None  # collected before the freeze, not frozen with the survivors
    finally:
        gc.unfreeze()
