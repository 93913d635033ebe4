"""Part 1 of the core benchmark (:mod:`benchmarks.core`): cost per activity with many
live connections. idlekeeper's activity stamp, as ``WatchedStream`` runs it, against
resetting an entered ``trio.CancelScope.deadline``, ``with trio.move_on_after(...)``
around each read, and a bare attribute store on a ``__slots__`` object.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import trio

import idlekeeper
from benchmarks.core.null_stream import NullStream
from idlekeeper.watch import WatchedStream

__all__ = ["activity_costs", "per_op_ns"]


def per_op_ns(loop: Callable[[], None], ops: int, repeats: int) -> float:
    """Median ns per operation over ``repeats`` runs of ``loop`` (which does ``ops``).

    The garbage collector is off while timing, as in ``timeit``: a collection
    triggered by one case's garbage would otherwise land in another's figure.
    """
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            loop()
            samples.append((time.perf_counter_ns() - t0) / ops)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples)


class _Slots:
    __slots__ = ("x",)

    def __init__(self) -> None:
        self.x = 0.0


async def activity_costs(conns: int, passes: int, repeats: int) -> dict[str, Any]:
    """Time each way of noting activity on ``conns`` live connections, ``passes`` times
    over each, in ``repeats`` interleaved rounds: ns per activity, gross and net of the
    loop, their ratios, and the whole wrapped ``receive_some`` call against the bare one."""
    results: dict[str, Any] = {"connections": conns}
    async with idlekeeper.open_keeper(tick=0.1) as keeper, trio.open_nursery() as nursery:
        streams: list[WatchedStream] = []
        scopes: list[trio.CancelScope] = []
        ready = trio.Event()
        null = NullStream()

        async def connection() -> None:
            with keeper.watch(null, idle=600) as w, trio.CancelScope(deadline=trio.current_time() + 600) as cs:
                streams.append(w.stream)
                scopes.append(cs)
                if len(streams) == conns:
                    ready.set()
                await trio.sleep_forever()

        for _ in range(conns):
            nursery.start_soon(connection)
        await ready.wait()
        objs = [_Slots() for _ in range(conns)]
        ops = conns * passes
        now = trio.current_time()

        # The two cheap statements are unrolled eight times per object so that the
        # loop itself does not drown them; the costly two run once per object.
        def empty() -> None:
            for _ in range(passes):
                for _s in streams:
                    pass

        def bare_store() -> None:
            # A float store on the very same connection objects: same memory, same
            # cache behaviour, so the difference is exactly the stamp's extra loads.
            value = 1.0
            for _ in range(passes):
                for o in streams:
                    o._rx = value
                    o._rx = value
                    o._rx = value
                    o._rx = value
                    o._rx = value
                    o._rx = value
                    o._rx = value
                    o._rx = value

        def bare_store_small() -> None:
            value = 1.0
            for _ in range(passes):
                for o in objs:
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value

        def idlekeeper_stamp() -> None:
            # Exactly the statement WatchedStream.receive_some runs per read.
            for _ in range(passes):
                for self in streams:
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current
                    self._rx = self._owner._epochs.current

        def cancel_scope_deadline() -> None:
            for p in range(passes):
                deadline = now + 600 + p
                for cs in scopes:
                    cs.deadline = deadline

        def move_on_after() -> None:
            for _ in range(passes):
                for _s in streams:
                    with trio.move_on_after(600):  # noqa: ASYNC100 - the scope's cost is what is timed
                        pass

        gc.collect()
        # Interleaved rounds, medians: drift on a shared machine hits all alike.
        cases: dict[str, tuple[Callable[[], None], int]] = {
            "loop": (empty, ops),
            "a_idlekeeper_stamp": (idlekeeper_stamp, ops * 8),
            "b_cancel_scope_deadline": (cancel_scope_deadline, ops),
            "c_move_on_after": (move_on_after, ops),
            "d_bare_store": (bare_store, ops * 8),
            "d2_bare_store_small_object": (bare_store_small, ops * 8),
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, (fn, count) in cases.items():
                samples[name].append(per_op_ns(fn, count, 1))
        loop = statistics.median(samples.pop("loop"))
        timed = {name: statistics.median(values) for name, values in samples.items()}
        # Loop overhead per operation: full for the costly two, an eighth for the unrolled.
        overhead = {name: loop / 8 if count > ops else loop for name, (_, count) in cases.items()}

        # The whole wrapper call, await included, against the bare transport's.
        stream = streams[0]
        calls = 200_000

        async def through(target: trio.abc.ReceiveStream) -> float:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                await target.receive_some()
            return (time.perf_counter_ns() - t0) / calls

        wrapped = statistics.median([await through(stream) for _ in range(repeats)])
        raw = statistics.median([await through(null) for _ in range(repeats)])
        nursery.cancel_scope.cancel()

    results["loop_overhead_ns"] = loop
    results["gross_ns"] = timed
    results["net_ns"] = {k: max(v - overhead[k], 0.01) for k, v in timed.items()}
    net = results["net_ns"]
    results["ratios"] = {
        "b_over_a_gross": timed["b_cancel_scope_deadline"] / timed["a_idlekeeper_stamp"],
        "c_over_a_gross": timed["c_move_on_after"] / timed["a_idlekeeper_stamp"],
        "a_over_d_gross": timed["a_idlekeeper_stamp"] / timed["d_bare_store"],
        "b_over_a_net": net["b_cancel_scope_deadline"] / net["a_idlekeeper_stamp"],
        "c_over_a_net": net["c_move_on_after"] / net["a_idlekeeper_stamp"],
        "a_over_d_net": net["a_idlekeeper_stamp"] / net["d_bare_store"],
        "a_over_d2_gross": timed["a_idlekeeper_stamp"] / timed["d2_bare_store_small_object"],
    }
    results["wrapper_call_ns"] = {"watched_stream": wrapped, "raw_stream": raw, "extra": wrapped - raw}
    return results
