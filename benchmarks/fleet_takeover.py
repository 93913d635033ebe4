"""Cross-node takeover latency of the Redis fleet coordinator, on loopback.

Two nodes on one throwaway ``redis-server``: a device's session is claimed on
node A, then again on node B; the time from B's ``online()`` call to A's host
being asked to evict is one sample. Prints p50/p99/max over ``--takeovers``.

    python -m benchmarks.fleet_takeover --takeovers 1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

from loadtest.redis_server import running_redis
from servers.heartbeat.coordination.fleet import RedisCoordinator
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.presence.event import PresenceEvent


class _Host:
    def __init__(self) -> None:
        self.evicted = trio.Event()
        self.at = 0.0

    def deliver(self, message: Publication, groups: object = None, plain: bool = True) -> None:
        pass

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        self.at = time.perf_counter()
        self.evicted.set()

    def sessions(self) -> list[PresenceEvent]:
        return []

    def filters(self) -> set[str]:
        return set()


def _online(client_id: str, epoch: str, node: str) -> PresenceEvent:
    return PresenceEvent("online", client_id, "127.0.0.1:1", None, 0.0, time.time(), epoch=epoch, node=node)


async def _measure(url: str, takeovers: int) -> list[float]:
    a_host, b_host = _Host(), _Host()
    a = RedisCoordinator(url, "bench-a")
    b = RedisCoordinator(url, "bench-b")
    samples = []
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run, a_host)
        await nursery.start(b.run, b_host)
        for i in range(takeovers):
            cid = f"dev-{i}"
            a.online(_online(cid, f"a{i}", "bench-a"))
            with trio.fail_after(5):
                await a.drain()
            a_host.evicted = trio.Event()
            started = time.perf_counter()
            b.online(_online(cid, f"b{i}", "bench-b"))
            with trio.fail_after(5):
                await a_host.evicted.wait()
            samples.append(a_host.at - started)
        nursery.cancel_scope.cancel()
    return samples


def main() -> None:
    """Run the measurement and print the percentiles."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--takeovers", type=int, default=1000)
    args = parser.parse_args()
    with running_redis() as server:
        samples = trio.run(_measure, server.url, args.takeovers)
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    print(
        f"{len(ms)} takeovers: p50 {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, "
        f"max {ms[-1]:.2f} ms, mean {statistics.fmean(ms):.2f} ms"
    )


if __name__ == "__main__":
    main()
