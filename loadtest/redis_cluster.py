"""A throwaway Redis Cluster on loopback ports: ``primaries`` ``redis-server`` processes
with cluster mode on, the slots shared out by ``redis-cli --cluster create``, and a
slot migration done the way ``redis-cli --cluster reshard`` does it, a few keys at a
time, so that clients meet ``ASK`` and ``TRYAGAIN`` while it runs.

For the tests and load runs of a fleet on Redis Cluster (``--cluster
redis+cluster://...``). No persistence. Every process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .processes import free_port
from .redis_server import RedisServer, ask, redis_server_binary

__all__ = ["RedisClusterSet", "running_cluster"]


def _cli() -> str:
    found = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if Path("/usr/bin/redis-cli").exists() else None)
    if found is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
    return found


class RedisClusterSet:
    """``primaries`` cluster-mode servers (at least 3, as ``redis-cli`` wants), no replicas."""

    def __init__(self, primaries: int = 3) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self._dir = Path(tempfile.mkdtemp(prefix="ik-cluster-"))
        self.servers: list[RedisServer] = []
        for n in range(primaries):
            extra = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self._dir / f"nodes-{n}.conf"),
                # The bus port is chosen, not port + 10000, which may be taken or past 65535.
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "2000",
                "--dir", str(self._dir),
            ]  # fmt: skip
            self.servers.append(RedisServer(binary=binary, extra=extra))
        self.cli = _cli()

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,.../``: what the gateways are given."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout: float = 30.0) -> None:
        """Start every server, share out the slots, and return once the cluster is ok."""
        for server in self.servers:
            server.start()
        create = [self.cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers)]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                ok = all("cluster_state:ok" in ask(s.port, "CLUSTER", "INFO") for s in self.servers)
                # Every node must also agree on who serves each slot before clients start.
                if ok and len({tuple(self._slot_owners(s.port)) for s in self.servers}) == 1:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the cluster was not ok within {timeout} s")

    def _run(self, port: int, *words: str) -> str:
        out = subprocess.run([self.cli, "-p", str(port), *words], check=True, capture_output=True, timeout=10.0)
        return out.stdout.decode().strip()

    def _node_id(self, port: int) -> str:
        return self._run(port, "CLUSTER", "MYID")

    def _slot_owners(self, port: int) -> list[str]:
        """``start-end:port`` for each range of slots, as the server on ``port`` sees them."""
        lines = self._run(port, "--no-raw", "CLUSTER", "SHARDS")
        return sorted(line for line in lines.splitlines() if "slots" in line) or [lines]

    def owner_of(self, slot: int) -> RedisServer:
        """The server that serves ``slot`` now (as the first server sees it)."""
        for line in self._run(self.servers[0].port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for part in fields[8:]:
                if part.startswith("["):
                    continue
                low, _, high = part.partition("-")
                if int(low) <= slot <= int(high or low):
                    return next(s for s in self.servers if s.port == port)
        raise LookupError(f"no server serves slot {slot}")

    def keys_in(self, slot: int) -> int:
        """How many keys ``slot`` holds, on the server that serves it."""
        return int(self._run(self.owner_of(slot).port, "CLUSTER", "COUNTKEYSINSLOT", str(slot)))

    def migrate_slot(self, slot: int, to: RedisServer | None = None, batch: int = 10, pause: float = 0.01) -> int:
        """Move ``slot`` to ``to`` (default: the next server after its owner), ``batch`` keys
        at a time with ``pause`` seconds between batches; returns how many keys moved."""
        source = self.owner_of(slot)
        if to is None:
            to = self.servers[(self.servers.index(source) + 1) % len(self.servers)]
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
        for server in [to, source, *(s for s in self.servers if s is not to and s is not source)]:
            self._run(server.port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
        return moved

    def stop(self) -> None:
        """Stop every server by its PID, and remove their files."""
        for server in self.servers:
            server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(primaries: int = 3) -> Iterator[RedisClusterSet]:
    """A started :class:`RedisClusterSet`, stopped on exit."""
    cluster = RedisClusterSet(primaries)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
