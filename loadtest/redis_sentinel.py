"""A throwaway Redis replicated and watched by Sentinels, on loopback ports: a primary,
its replicas, and Sentinels (``redis-server --sentinel``) that fail it over.

For the tests and load runs of a fleet on Sentinel (``--cluster
redis+sentinel://...``). No persistence. Every process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .processes import free_port, stop
from .redis_server import RedisServer, ask, redis_server_binary

__all__ = ["SERVICE", "SentinelSet", "running_sentinels"]

SERVICE = "fleet"
"""The name the Sentinels monitor the primary under."""


class SentinelSet:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels (quorum ``quorum``).

    With two replicas or more, each server refuses writes while it is a primary with
    no replica in sync (after a failover, one of the replicas follows the new primary).

    ``down_after`` (ms) is how long the Sentinels wait before they call the primary
    down; the failover follows within a second or two of that.
    """

    def __init__(self, replicas: int = 2, sentinels: int = 3, quorum: int = 2, down_after: int = 1000) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        # Every server may be promoted, and so serve replicas: none waits 5 s (Redis 7's
        # default) for more replicas before it starts a full sync.
        self._dir = Path(tempfile.mkdtemp(prefix="ik-sentinel-"))
        # A replica's full sync may write an RDB file: into the set's own directory. A
        # primary that lost its replicas refuses writes (min-replicas-to-write), as
        # Redis advises under Sentinel: one that hung and runs again after a failover
        # would otherwise take writes the promoted replica never sees, until the
        # Sentinels demote it and they are gone.
        fast = ["--repl-diskless-sync-delay", "0", "--dir", str(self._dir)]
        if replicas > 1:
            fast += ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"]
        self.primary = RedisServer(binary=binary, extra=fast)
        self.replicas = [
            RedisServer(binary=binary, extra=[*fast, "--replicaof", "127.0.0.1", str(self.primary.port)])
            for _ in range(replicas)
        ]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.quorum = quorum
        self.down_after = down_after
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:P1,.../fleet/0``: what the gateways are given."""
        where = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{where}/{SERVICE}/0"

    @property
    def servers(self) -> list[RedisServer]:
        """The data servers, the first primary at the start."""
        return [self.primary, *self.replicas]

    def start(self, timeout: float = 30.0) -> None:
        """Start everything; return once every replica is in sync and the Sentinels know it."""
        for server in self.servers:
            server.start()
        for n, port in enumerate(self.sentinel_ports):
            conf = self._dir / f"sentinel-{n}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self._dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after}\n"
                f"sentinel failover-timeout {SERVICE} {max(3 * self.down_after, 3000)}\n"
            )
            cmd = [self.binary, str(conf), "--sentinel", "--loglevel", "warning"]
            self._sentinels.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        want = {str(r.port) for r in self.replicas}
        while time.monotonic() < deadline:
            try:
                synced = all("master_link_status:up" in ask(r.port, "INFO", "replication") for r in self.replicas)
                known = all(want <= set(ask(port, "SENTINEL", "REPLICAS", SERVICE)) for port in self.sentinel_ports)
                if synced and known:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the Sentinels did not see every replica within {timeout} s")

    def primary_port(self) -> int | None:
        """The primary's port as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                reply = ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            except OSError:
                continue
            if len(reply) == 2 and reply[1].isdigit():
                return int(reply[1])
        return None

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary (by PID); the server killed."""
        port = self.primary_port()
        victim = next(s for s in self.servers if s.port == port)
        victim.kill()
        return victim

    def stall_primary(self) -> RedisServer:
        """SIGSTOP the current primary (by PID): a machine that hangs; :meth:`resume` it."""
        port = self.primary_port()
        victim = next(s for s in self.servers if s.port == port)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        return victim

    @staticmethod
    def resume(server: RedisServer) -> None:
        """SIGCONT a server :meth:`stall_primary` stopped."""
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> float:
        """Seconds until the Sentinels name a primary other than ``old_port`` that answers as one."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            port = self.primary_port()
            if port is not None and port != old_port:
                with contextlib.suppress(OSError):
                    if "role:master" in ask(port, "INFO", "replication"):
                        return time.monotonic() - started
            time.sleep(0.1)
        raise RuntimeError(f"no failover within {timeout} s")

    def stop(self) -> None:
        """Stop every process by its PID, and remove their files."""
        for server in self.servers:
            self.resume(server)  # a stalled one could not hear its SIGTERM
        for proc in self._sentinels:
            stop(proc, 10.0)
        self._sentinels = []
        for server in self.servers:
            server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def running_sentinels(**kw: int) -> Iterator[SentinelSet]:
    """A started :class:`SentinelSet`, stopped on exit."""
    group = SentinelSet(**kw)
    group.start()
    try:
        yield group
    finally:
        group.stop()
