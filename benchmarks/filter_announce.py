"""What announcing filters to the other workers costs: the seconds and the server's CPU
(supervisor and workers) for one client to subscribe to ``--filters`` distinct filters,
then for ``--clients`` clients at once to subscribe to as many each, all distinct.

    python -m benchmarks.filter_announce [--roots DIR[,DIR...]] [--workers 2]
                                         [--filters 1000] [--clients 10]

One filter a SUBSCRIBE (``cmd/<client>/<i>``, a device's own command topic), 200 in
flight per client, timed to the last SUBACK. A server is started afresh per source tree
of ``--roots`` (a copy of an earlier commit, say), on a free loopback port, with
``--max-subscriptions 100000``, and stopped by its PID.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from loadtest.processes import free_port, start_heartbeat, stop
from loadtest.sampler import cpu_seconds, process_tree
from servers.heartbeat.mqtt import encoders

from .topics_load import Client

__all__ = ["main", "subscribe_many"]

ROOT = Path(__file__).resolve().parent.parent
BOUND = 600.0
"""Seconds a phase may take before the run gives up."""
_SUBACK = 0x90


async def subscribe_many(port: int, name: str, count: int, batch: int = 200) -> None:
    """Connect as ``name`` and subscribe to ``cmd/<name>/0`` .. ``cmd/<name>/<count-1>``, one a SUBSCRIBE."""
    client = await Client.connect(port, name)
    for first in range(0, count, batch):
        ids = range(first, min(count, first + batch))
        await client.send(b"".join(encoders.encode_subscribe(1 + i, [(f"cmd/{name}/{i}", 0)]) for i in ids))
        for _ in ids:
            kind, _body = await client.packet()
            while kind & 0xF0 != _SUBACK:
                kind, _body = await client.packet()
    await client.close()


async def _phases(port: int, pid: int, filters: int, clients: int) -> list[tuple[float, float]]:
    """(seconds, server CPU seconds) of the lone client's phase and the many clients' phase."""
    out = []
    for names in (["lone"], [f"c{k}" for k in range(clients)]):
        cpu0, started = cpu_seconds(process_tree(pid)), time.perf_counter()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                for name in names:
                    nursery.start_soon(subscribe_many, port, name, filters)
        out.append((time.perf_counter() - started, cpu_seconds(process_tree(pid)) - cpu0))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run every tree of ``--roots`` in turn and print one table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.filter_announce", description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", default=str(ROOT), help="comma-separated source trees to run the server from")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--filters", type=int, default=1000, help="filters per client")
    p.add_argument("--clients", type=int, default=10)
    args = p.parse_args(argv)
    print(f"| tree | 1 client x {args.filters:,} | CPU | {args.clients} clients x {args.filters:,} | CPU |")
    print("|---|---|---|---|---|")
    for root in [str(Path(r).resolve()) for r in args.roots.split(",") if r]:
        port = free_port(run=args.workers + 1)
        extra = ["--max-subscriptions", "100000", "--max-subscription-bytes", "10000000"]
        proc = start_heartbeat(port, args.workers, extra, cwd=root)
        try:
            (lone, lone_cpu), (many, many_cpu) = trio.run(_phases, port, proc.pid, args.filters, args.clients)
        finally:
            stop(proc)
        print(f"| {root} | {lone:.2f} s | {lone_cpu:.2f} s | {many:.2f} s | {many_cpu:.2f} s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
