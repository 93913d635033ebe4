"""A throwaway Redis Cluster on loopback ports: ``primaries`` ``redis-server`` processes
with cluster mode on (and ``replicas`` replicas of each), the slots shared out by
``redis-cli --cluster create``, and a slot migration done the way ``redis-cli --cluster
reshard`` does it, a few keys at a time, so that clients meet ``ASK`` and ``TRYAGAIN``
while it runs.

With replicas, a primary can be lost the way a machine is (SIGKILL), its replica
stopped and let run again (SIGSTOP, SIGCONT), and its replication link cut, so that
writes it took are lost in the failover that follows, as asynchronous replication
loses them.

For the tests and load runs of a fleet on Redis Cluster (``--cluster
redis+cluster://...``). No persistence. Every process is stopped (and signalled) by
its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from .processes import free_port
from .redis_server import RedisServer, ask, redis_server_binary

__all__ = ["ClusterNode", "RedisClusterSet", "busiest_primary", "running_cluster"]


def _cli() -> str:
    found = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if Path("/usr/bin/redis-cli").exists() else None)
    if found is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
    return found


class ClusterNode(NamedTuple):
    """A line of ``CLUSTER NODES``: one server as a node of the cluster sees it."""

    id: str
    port: int
    flags: frozenset[str]
    """``myself``, ``master``, ``slave``, ``fail?``, ``fail``, ..."""
    primary: str
    """The id of the primary it replicates (``-`` for a primary)."""
    slots: tuple[tuple[int, int], ...]
    """The ranges of slots it serves (first, last), none for a replica."""


def _parse_nodes(text: str) -> list[ClusterNode]:
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        ranges = []
        for part in fields[8:]:
            if part.startswith("["):  # a slot being imported or migrated: not served yet
                continue
            low, _, high = part.partition("-")
            ranges.append((int(low), int(high or low)))
        nodes.append(ClusterNode(fields[0], port, frozenset(fields[2].split(",")), fields[3], tuple(ranges)))
    return nodes


def busiest_primary(nodes: list[ClusterNode], slots: list[int], spare: int | None = None) -> ClusterNode:
    """The primary among ``nodes`` that serves the most of ``slots`` (the first listed on
    a tie), passing over the one that serves ``spare`` while another serves any of them."""

    def serves(node: ClusterNode, slot: int) -> bool:
        return any(low <= slot <= high for low, high in node.slots)

    primaries = [n for n in nodes if "master" in n.flags and "fail" not in n.flags and n.slots]
    if not primaries:
        raise LookupError("no primary serves a slot")
    others = [n for n in primaries if spare is None or not serves(n, spare)]
    if any(serves(n, slot) for n in others for slot in slots):
        primaries = others
    return max(primaries, key=lambda n: sum(1 for slot in slots if serves(n, slot)))


class RedisClusterSet:
    """``primaries`` cluster-mode servers (at least 3, as ``redis-cli`` wants), each with
    ``replicas`` replicas (none by default).

    ``servers`` lists every server, primaries and replicas alike; which is which is
    what the cluster says (:meth:`nodes`), and changes with a failover.
    """

    def __init__(self, primaries: int = 3, replicas: int = 0) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.replicas = replicas
        self._dir = Path(tempfile.mkdtemp(prefix="ik-cluster-"))
        self.servers: list[RedisServer] = []
        self._paused: set[int] = set()  # the ports of servers SIGSTOPped and not yet let run
        for n in range(primaries * (1 + replicas)):
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self._dir / f"nodes-{n}.conf"),
                # The bus port is chosen, not port + 10000, which may be taken or past 65535.
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "2000",
                "--dir", str(self._dir),
                # A replica's first sync at once, not after Redis 7's 5 s wait for others.
                "--repl-diskless-sync-delay", "0",
            ]  # fmt: skip
            self.servers.append(RedisServer(binary=binary, extra=extra))
        self.cli = _cli()

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,.../``: what the gateways are given."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout: float = 30.0) -> None:
        """Start every server, share out the slots (and the replicas), and return once
        the cluster is ok and every replica is in sync with its primary."""
        for server in self.servers:
            server.start()
        create = [self.cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers)]
        create += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=timeout)
        try:
            self._wait(self._settled, timeout, "the cluster was not ok")
        except RuntimeError:
            self.stop()
            raise

    def _settled(self) -> bool:
        live = self._live()
        if not all("cluster_state:ok" in ask(s.port, "CLUSTER", "INFO") for s in live):
            return False
        # Every node must also agree on who serves each slot before clients start.
        if len({tuple(self._slot_owners(s.port)) for s in live}) != 1:
            return False
        views = [self.nodes(s) for s in live]
        # ... and on which are replicas, each in sync: a write is then lost only on purpose.
        if len({frozenset((n.id, n.primary) for n in view) for view in views}) != 1:
            return False
        copies = [n for n in views[0] if "slave" in n.flags and "fail" not in n.flags]
        if len(copies) < self.replicas * sum(1 for n in views[0] if n.slots):
            return False
        return all(
            "master_link_status:up" in ask(n.port, "INFO", "replication") for n in copies if n.port not in self._paused
        )

    def _wait(self, check: Callable[[], bool], timeout: float, what: str) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if check():
                    return time.monotonic() - started
            time.sleep(0.1)
        raise RuntimeError(f"{what} within {timeout} s")

    def _live(self) -> list[RedisServer]:
        """The servers that run and answer: not killed, not stopped."""
        return [s for s in self.servers if s.pid is not None and s.port not in self._paused]

    def _run(self, port: int, *words: str) -> str:
        out = subprocess.run([self.cli, "-p", str(port), *words], check=True, capture_output=True, timeout=10.0)
        return out.stdout.decode().strip()

    def _node_id(self, port: int) -> str:
        return self._run(port, "CLUSTER", "MYID")

    def _slot_owners(self, port: int) -> list[str]:
        """``start-end:port`` for each range of slots, as the server on ``port`` sees them."""
        lines = self._run(port, "--no-raw", "CLUSTER", "SHARDS")
        return sorted(line for line in lines.splitlines() if "slots" in line) or [lines]

    def nodes(self, seen_by: RedisServer | None = None) -> list[ClusterNode]:
        """Every node of the cluster, as ``seen_by`` (default: the first live server) sees it."""
        server = seen_by or self._live()[0]
        return _parse_nodes(self._run(server.port, "CLUSTER", "NODES"))

    def _server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def owner_of(self, slot: int, seen_by: RedisServer | None = None) -> RedisServer:
        """The primary that serves ``slot`` now (as ``seen_by``, default the first live
        server, sees it: until a failover, a primary lost still serves its slots)."""
        for node in self.nodes(seen_by):
            if any(low <= slot <= high for low, high in node.slots):
                return self._server(node.port)
        raise LookupError(f"no server serves slot {slot}")

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The servers that replicate ``primary``."""
        nodes = self.nodes()
        ids = {n.port: n.id for n in nodes}
        return [self._server(n.port) for n in nodes if n.primary == ids.get(primary.port)]

    def slots_of(self, primary: RedisServer) -> list[tuple[int, int]]:
        """The ranges of slots ``primary`` serves (first, last)."""
        return [r for n in self.nodes() if n.port == primary.port for r in n.slots]

    def busiest(self, slots: list[int], spare: int | None = None) -> RedisServer:
        """The primary that serves the most of ``slots`` now, not the one serving ``spare``
        if another serves any of them (:func:`busiest_primary`)."""
        return self._server(busiest_primary(self.nodes(), slots, spare).port)

    def keys_in(self, slot: int) -> int:
        """How many keys ``slot`` holds, on the server that serves it."""
        return int(self._run(self.owner_of(slot).port, "CLUSTER", "COUNTKEYSINSLOT", str(slot)))

    def kill(self, server: RedisServer) -> None:
        """SIGKILL ``server`` by its PID: a machine lost, its unreplicated writes with it."""
        self._paused.discard(server.port)
        server.kill()

    def pause(self, server: RedisServer) -> None:
        """SIGSTOP ``server`` by its PID: it hangs, and reads nothing, until :meth:`resume`."""
        assert server.pid is not None, "not running"
        os.kill(server.pid, signal.SIGSTOP)
        self._paused.add(server.port)

    def resume(self, server: RedisServer) -> None:
        """SIGCONT a server :meth:`pause` stopped."""
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        self._paused.discard(server.port)

    def cut_replicas(self, primary: RedisServer) -> int:
        """Close ``primary``'s links to its replicas; how many it closed.

        A replica stopped with :meth:`pause` still gets the replication stream: the
        kernel takes it into the stopped process's socket, and it applies it once let
        run. With the link closed while the replica is stopped, the primary's writes
        from then on are in its own memory only, until the replica reconnects: kill the
        primary before that, and the replica is promoted without them."""
        return int(self._run(primary.port, "CLIENT", "KILL", "TYPE", "replica"))

    def wait_failover(self, slot: int, old: RedisServer, timeout: float = 30.0) -> tuple[RedisServer, float]:
        """Wait until every live server says the cluster is ok and that a server other
        than ``old`` serves ``slot``, as a primary; that server, and the seconds it took."""
        found: list[RedisServer] = []

        def promoted() -> bool:
            live = self._live()
            if not all("cluster_state:ok" in ask(s.port, "CLUSTER", "INFO") for s in live):
                return False
            owners = {self.owner_of(slot, s).port for s in live}
            if len(owners) != 1 or old.port in owners:
                return False
            found[:] = [self._server(owners.pop())]
            return "role:master" in ask(found[0].port, "INFO", "replication")

        took = self._wait(promoted, timeout, f"no primary but {old.port} took slot {slot}")
        return found[0], took

    def migrate_slot(self, slot: int, to: RedisServer | None = None, batch: int = 10, pause: float = 0.01) -> int:
        """Move ``slot`` to ``to`` (default: the next primary after its owner), ``batch``
        keys at a time with ``pause`` seconds between batches; returns how many keys moved."""
        source = self.owner_of(slot)
        serving = {n.port for n in self.nodes() if "master" in n.flags and "fail" not in n.flags}
        primaries = [s for s in self.servers if s.port in serving]  # in the order they were made
        if to is None:
            to = primaries[(primaries.index(source) + 1) % len(primaries)]
        if to is source:
            return 0
        src_id, dst_id = self._node_id(source.port), self._node_id(to.port)
        self._run(to.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
        self._run(source.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
        moved = 0
        while True:
            keys = self._run(source.port, "CLUSTER", "GETKEYSINSLOT", str(slot), str(batch)).split()
            if not keys:
                break
            self._run(source.port, "MIGRATE", "127.0.0.1", str(to.port), "", "0", "5000", "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause)
        # The new owner first, then the old, then the rest: as redis-cli does.
        for server in [to, source, *(s for s in primaries if s is not to and s is not source)]:
            self._run(server.port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
        return moved

    def stop(self) -> None:
        """Stop every server by its PID (a stopped one let run first, to hear its SIGTERM),
        and remove their files."""
        for server in self.servers:
            if server.port in self._paused:
                self.resume(server)
            server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(primaries: int = 3, replicas: int = 0) -> Iterator[RedisClusterSet]:
    """A started :class:`RedisClusterSet`, stopped on exit."""
    cluster = RedisClusterSet(primaries, replicas)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
