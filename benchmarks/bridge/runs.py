"""The three measurements of the bridge benchmark, for one kind of edge or both."""

from __future__ import annotations

import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from . import brokers, sockets
from .brokers import Process
from .clients import Client, connect

Result = dict[str, Any]


async def _start(process: Process) -> None:
    await trio.to_thread.run_sync(process.start)


async def _stop(process: Process) -> None:
    await trio.to_thread.run_sync(process.stop)


async def _edge_up(nursery: trio.Nursery, kind: str, port: int, seconds: float = 20.0) -> Client:
    """A client on the edge watching its notification, once it says ``1``."""
    watch = await connect(nursery, port, f"watch-{kind}")
    await watch.subscribe(brokers.state_topic(kind), 1)
    await _wait_for(lambda: watch.arrived.get(b"1") is not None, seconds)
    return watch


async def _wait_for(check: Callable[[], bool], seconds: float) -> bool:
    """Poll ``check`` (bounded); whether it came true."""
    with trio.move_on_after(seconds):
        while True:
            if check():
                return True
            await trio.sleep(0.005)
    return False


async def _settle(received: Callable[[], int], want: int, idle: float, seconds: float) -> None:
    """Wait until ``want`` arrived, or nothing new for ``idle`` s, or ``seconds`` in all."""
    with trio.move_on_after(seconds):
        last, since = received(), trio.current_time()
        while received() < want:
            await trio.sleep(0.01)
            if received() != last:
                last, since = received(), trio.current_time()
            elif trio.current_time() - since > idle:
                return


async def throughput(
    kind: str, binary: str, workdir: Path, counts: dict[int, int], window: int, seconds: float, queued: int = 1000
) -> Result:
    """Messages a second through an edge of ``kind``, for each QoS in ``counts``."""
    remote = brokers.remote(binary, workdir)
    await _start(remote)
    edge = brokers.edge(kind, binary, workdir, remote.port, 60, queued)
    result: Result = {}
    try:
        await _start(edge)
        async with trio.open_nursery() as nursery:
            await _edge_up(nursery, kind, edge.port)
            for qos, total in counts.items():
                sink = await connect(nursery, remote.port, f"sink-{qos}")
                await sink.subscribe(brokers.TOPIC, 1)
                await trio.sleep(0.3)
                source = await connect(nursery, edge.port, f"source-{qos}", window=window)
                prefix = b"%d-" % qos
                start = trio.current_time()
                published = 0
                with trio.move_on_after(seconds):
                    for n in range(total):
                        source.session.publish("bench/t", prefix + b"%d" % n, qos)
                        published += 1
                        if n % 100 == 99:
                            await source.flush()
                            if qos:
                                await source.room(window, seconds)
                    await source.flush()
                left = max(1.0, seconds - (trio.current_time() - start))
                await _settle(partial(len, sink.arrived), total, 3.0, left)
                times = list(sink.arrived.values())
                took = (max(times) - start) if times else float("nan")
                got = len(sink.arrived)
                result[f"qos{qos}"] = {
                    "messages": total,
                    "published": published,
                    "received": got,
                    "lost": total - got,
                    "seconds": round(took, 3),
                    "rate": round(got / took, 1) if times and took > 0 else 0.0,
                }
                result[f"qos{qos}"]["acknowledged_by_edge"] = source.acked
                await source.aclose()
                await sink.aclose()
            nursery.cancel_scope.cancel()
    finally:
        await _stop(edge)
        await _stop(remote)
    return result


async def stopped_remote(binary: str, workdir: Path, keepalive: int, seconds: float) -> dict[str, Result]:
    """An edge of each kind on a remote of its own; both remotes SIGSTOPped at once, then
    SIGCONTed: when each edge dropped its connection (and, ours, said ``0``), and when
    a probe published on it reached its remote again."""
    remotes = {kind: brokers.remote(binary, workdir) for kind in brokers.KINDS}
    edges: dict[str, Process] = {}
    out: dict[str, Result] = {kind: {"keepalive": keepalive} for kind in remotes}
    try:
        for kind, remote in remotes.items():
            await _start(remote)
            edges[kind] = brokers.edge(kind, binary, workdir, remote.port, keepalive)
            await _start(edges[kind])
        async with trio.open_nursery() as nursery:
            watches = {kind: await _edge_up(nursery, kind, p.port) for kind, p in edges.items()}
            sinks = {kind: await connect(nursery, r.port, f"sink-{kind}") for kind, r in remotes.items()}
            for sink in sinks.values():
                await sink.subscribe("bench/probe/#", 0)
            probes = {kind: await connect(nursery, p.port, f"probe-{kind}") for kind, p in edges.items()}
            await trio.sleep(0.5)
            bridges = {kind: sockets.bridge_socket(r.port, {_local_port(sinks[kind])}) for kind, r in remotes.items()}
            for watch in watches.values():
                watch.by_topic.clear()
            for remote in remotes.values():
                remote.proc.send_signal(signal.SIGSTOP)
            stopped = trio.current_time()
            dropped: dict[str, float] = {}
            said: dict[str, float] = {}

            def noticed() -> bool:
                now = trio.current_time()
                for kind, remote in remotes.items():
                    port = bridges[kind]
                    if kind not in dropped and port is not None and not sockets.established(remote.port, port):
                        dropped[kind] = now - stopped
                    zeros = [t for p, t in watches[kind].by_topic.get(brokers.state_topic(kind), []) if p == b"0"]
                    if zeros and kind not in said:
                        said[kind] = zeros[0] - stopped
                return len(dropped) == len(remotes) and "ours" in said

            await _wait_for(noticed, 4 * keepalive + seconds)
            for remote in remotes.values():
                remote.proc.send_signal(signal.SIGCONT)
            resumed = trio.current_time()
            back: dict[str, float] = {}

            async def probe(kind: str, client: Client) -> None:
                n = 0
                while kind not in back:
                    client.session.publish(f"bench/probe/{kind}", b"%d" % n, 0)
                    await client.flush()
                    n += 1
                    await trio.sleep(0.02)

            def served() -> bool:
                for kind, sink in sinks.items():
                    if kind not in back and sink.by_topic:
                        back[kind] = min(t for got in sink.by_topic.values() for _, t in got) - resumed
                return len(back) == len(sinks)

            async with trio.open_nursery() as probing:
                for kind, client in probes.items():
                    probing.start_soon(probe, kind, client)
                await _wait_for(served, seconds)
                probing.cancel_scope.cancel()
            for kind, figures in out.items():
                figures["noticed_s"] = _rounded(dropped.get(kind))
                figures["notification_0_s"] = _rounded(said.get(kind))
                figures["serving_again_s"] = _rounded(back.get(kind))
            nursery.cancel_scope.cancel()
    finally:
        for process in [*edges.values(), *remotes.values()]:
            await _stop(process)
    return out


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _local_port(client: Client) -> int:
    assert client.stream is not None
    port = client.stream.socket.getsockname()[1]
    assert isinstance(port, int)
    return port


async def restart_under_load(
    kind: str, binary: str, workdir: Path, total: int, rate: float, window: int, seconds: float, queued: int = 1000
) -> Result:
    """QoS 1 at ``rate`` a second through an edge of ``kind`` while the remote is SIGKILLed
    a third of the way through and started again; what reached its subscriber."""
    state = workdir / f"restart-{kind}"
    state.mkdir()
    remote = brokers.remote(binary, state, persistent=True)
    await _start(remote)
    edge = brokers.edge(kind, binary, workdir, remote.port, 60, queued)
    sinks: list[Client] = []
    try:
        await _start(edge)
        async with trio.open_nursery() as nursery:
            await _edge_up(nursery, kind, edge.port)
            first = await connect(nursery, remote.port, "sink-restart", clean=False)
            await first.subscribe(brokers.TOPIC, 1)
            sinks.append(first)
            await trio.sleep(1.6)  # the session autosaved (each second) before the kill
            source = await connect(nursery, edge.port, "source-restart", window=window)
            start = trio.current_time()
            killed_at = total // 3
            restarted = 0.0
            published = 0
            for n in range(total):
                source.session.publish("bench/r", b"%d" % n, 1)
                published += 1
                await source.flush()
                if n == killed_at:
                    await trio.to_thread.run_sync(remote.kill)
                    await _start(remote)
                    restarted = trio.current_time()
                    with trio.fail_after(10):
                        again = await connect(nursery, remote.port, "sink-restart", clean=False)
                    await again.subscribe(brokers.TOPIC, 1)
                    sinks.append(again)
                await trio.sleep_until(start + (n + 1) / rate)
                if trio.current_time() - start > seconds:
                    break

            def got() -> int:
                return len({p for sink in sinks for p in sink.arrived})

            await _settle(got, published, 10.0, seconds)
            done = max((t for sink in sinks for t in sink.arrived.values()), default=start)
            result: Result = {
                "messages": total,
                "published": published,
                "rate": rate,
                "received": got(),
                "lost": published - got(),
                "acknowledged_by_edge": source.acked,
                "restarted_at_s": round(restarted - start, 3) if restarted else None,
                "all_in_s": round(done - start, 3),
            }
            nursery.cancel_scope.cancel()
    finally:
        await _stop(edge)
        await _stop(remote)
    return result
