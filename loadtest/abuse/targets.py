"""The servers an abuse run attacks, each started afresh for every attack with the
options that attack needs, and stopped by PID:

- ``idlekeeper``: ``python -m servers.heartbeat``, one worker, with a presence log (the
  judge compares what subscribers were told with it) and a status port (/healthz is
  polled throughout);
- ``fleet``: ours as a gateway of a Redis fleet (``--cluster``) on a ``redis-server``
  of its own, whose memory counts with the server's: what an attack puts into Redis
  (device records, retained messages, sessions) is judged with the rest;
- ``mosquitto``: the Debian package's broker as :func:`~loadtest.mqtt_targets.start_mosquitto`
  runs it, with the same ACL file where the attack needs one. It has neither presence
  topics nor a status port: the checks of those do not apply to it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX

from ..mqtt_targets import MqttTarget, start_mosquitto
from ..processes import free_port, start_heartbeat, stop
from ..redis_server import RedisServer
from ..sampler import process_tree

__all__ = ["ACL_RULES", "OURS", "TARGETS", "AbuseServer", "is_ours", "start_target"]

TARGETS = ("idlekeeper", "fleet", "mosquitto")
OURS = ("idlekeeper", "fleet")
"""The targets that are our server (presence topics, a status port, judged for the exit status)."""


def is_ours(target: str) -> bool:
    """Whether ``target`` is our server, on its own or in a fleet."""
    return target in OURS


ACL_RULES = (
    "# The abuse test's rules, in Mosquitto's acl_file format: anonymous clients may read\n"
    "# presence, and each client reads and writes its own tree under devices/.\n"
    f"topic read {DEFAULT_PRESENCE_PREFIX}#\n"
    "pattern readwrite devices/%c/#\n"
)


@dataclass
class AbuseServer:
    """A server started for one attack."""

    name: str
    proc: subprocess.Popen[str]
    port: int
    workdir: Path
    status_port: int | None = None
    presence_log: Path | None = None
    peer: MqttTarget | None = field(default=None, repr=False)
    redis: RedisServer | None = field(default=None, repr=False)

    def pids(self) -> list[int]:
        """The server's processes (a supervisor and its workers, or Mosquitto; and a fleet's Redis)."""
        pids = [p.pid for p in process_tree(self.proc.pid)]
        if self.redis is not None and self.redis.pid is not None:
            pids.append(self.redis.pid)
        return pids

    def died(self) -> str:
        """Why the server is gone, or empty while it runs."""
        code = self.proc.poll()
        return "" if code is None else f"exited with {code} during the run"

    def stop(self) -> None:
        """SIGTERM by PID (SIGKILL if it lingers); its scratch files go (not the presence log: see :meth:`remove`)."""
        if self.peer is not None:
            self.peer.stop()
        else:
            stop(self.proc, timeout=30)
        if self.redis is not None:
            self.redis.stop()

    def remove(self) -> None:
        """Delete the run's files (the ACL file, the presence log)."""
        shutil.rmtree(self.workdir, ignore_errors=True)


def _workdir(acl: bool) -> tuple[Path, Path | None]:
    workdir = Path(tempfile.mkdtemp(prefix="ik-abuse-"))
    if not acl:
        return workdir, None
    path = workdir / "acl"
    path.write_text(ACL_RULES)
    # Mosquitto started as root reads its ACL file as its own user.
    workdir.chmod(0o755)
    path.chmod(0o644)
    return workdir, path


def start_target(
    name: str,
    ours_args: Sequence[str] = (),
    *,
    acl: bool = False,
    mosquitto_config: str = "",
    ours_root: str | None = None,
) -> AbuseServer:
    """Start ``name`` on a free loopback port; ``ours_args`` are more options for ours,
    ``mosquitto_config`` more lines for Mosquitto's; ``acl``: both get :data:`ACL_RULES`.
    ``ours_root``: the source tree ours runs from (another checkout, to compare; default this one)."""
    workdir, acl_file = _workdir(acl)
    port = free_port()
    try:
        if is_ours(name):
            status = free_port()
            log = workdir / "presence.jsonl"
            extra = ["--presence-log", str(log), "--status-port", str(status), *ours_args]
            if acl_file is not None:
                extra += ["--acl-file", str(acl_file)]
            redis = None
            if name == "fleet":
                redis = RedisServer()
                redis.start()
                extra += ["--cluster", redis.url, "--node", "abuse"]
            try:
                proc = start_heartbeat(port, 1, extra, cwd=ours_root)
            except BaseException:
                if redis is not None:
                    redis.stop()
                raise
            return AbuseServer(name, proc, port, workdir, status, log, redis=redis)
        if name == "mosquitto":
            config = mosquitto_config + (f"acl_file {acl_file}\n" if acl_file is not None else "")
            peer = start_mosquitto(name, port, config)
            return AbuseServer(name, peer.proc, port, workdir, peer=peer)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    raise ValueError(f"unknown target {name!r}: one of {', '.join(TARGETS)}")
