"""Start-up time and memory against what the durable store holds.

:func:`build_store` writes a store through the server's own classes: a
:class:`~servers.heartbeat.coordination.durable.Durability` following a registry, a
retention and a session store, filled through their APIs (device records, persistent
sessions, the messages queued for them), then one commit; the file is left as a
crash leaves it (not marked stopped), so the start ends the devices recorded online,
``server-lost``, as it would after a ``kill -9``.

:func:`measure_start` copies it, starts the server on the copy and times the
seconds from starting the process to its first CONNACK, then reads the RSS of its
processes and the line the server logs about what it restored.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.broker.outbox import Message
from servers.heartbeat.broker.persistent import SessionStore
from servers.heartbeat.coordination.durable import Durability
from servers.heartbeat.coordination.registry import Registry
from servers.heartbeat.coordination.retention import MqttState
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX
from servers.heartbeat.presence.event import PresenceEvent

from .clients import Client, Subscriber, drive, payload

__all__ = ["Built", "Started", "build_store", "measure_start"]

_RESTORED = re.compile(
    r"(\d+) device records, (\d+) retained messages, (\d+) persistent sessions with (\d+) messages"
    r" restored in ([\d.]+) s"
)


@dataclass(frozen=True)
class Built:
    """A store :func:`build_store` wrote."""

    devices: int
    online: int
    sessions: int
    queued: int
    seconds: float
    size: int
    """Bytes of the file."""


def build_store(path: Path, devices: int, online: int, sessions: int, queued: int, size: int = 32) -> Built:
    """Write a store at ``path`` holding ``devices`` device records (the first ``online``
    of them online) and ``sessions`` persistent sessions (client ids ``sess-N``, each
    subscribed to ``fleet/N/cmd`` at QoS 1) with ``queued`` QoS 1 messages of ``size``
    bytes each, as a server that died (``kill -9``) leaves it."""
    started = time.perf_counter()
    durability = Durability(str(path), store_clock=time.time)
    registry = Registry(max_records=max(devices, 1))
    store = SessionStore(max_queued=max(queued, 1), max_queued_bytes=1 << 30, total_queued_bytes=1 << 40)
    retention = MqttState(store=store).retention(registry, DEFAULT_PRESENCE_PREFIX, time.time)
    durability.restore(registry, retention, store)
    now = time.time()
    for i in range(devices):
        event = PresenceEvent(
            "online", f"dev-{i:06d}", "127.0.0.1:40000", None, 0.0, now, epoch=f"built.{i}", keep_alive=60,
            protocol_level=4,
        )  # fmt: skip
        registry.online(event)
        if i >= online:
            registry.offline(dataclasses.replace(event, status="offline", reason=Offline.DISCONNECT))
    for s in range(sessions):
        client_id, topic = f"sess-{s:05d}", f"fleet/{s}/cmd"
        store.open(client_id, False, now)
        store.subscribe(client_id, topic, 1)
        for q in range(queued):
            store.push(client_id, Message(topic, payload(q, size), 1))
    if not durability.commit():
        raise RuntimeError(f"{path}: the store could not be written ({durability.failure})")
    durability.close(clean=False)
    return Built(devices, online, sessions, queued, time.perf_counter() - started, path.stat().st_size)


@dataclass(frozen=True)
class Started:
    """One start of the server on a store."""

    connack: float
    """Seconds from starting the process to its first CONNACK."""
    rss: int
    """Bytes resident in all its processes, the most seen in the seconds after."""
    holder_rss: int
    """Bytes resident in the process that holds the store (the worker, or the supervisor)."""
    restored: tuple[int, int, int, int] | None
    """Device records, retained messages, sessions and messages the server said it restored."""
    restore_seconds: float
    resumed: int
    """Messages a resumed session got (``sess-00000``; -1: not tried)."""


def measure_start(store: Path, workdir: Path, workers: int, resume: int = 0) -> Started:
    """Start the server on a copy of ``store`` with ``workers``; time its first CONNACK,
    read its memory; with ``resume``, resume session ``sess-00000`` and count what it
    gets (``resume`` expected)."""
    copy = workdir / f"start-{workers}.db"
    shutil.copyfile(store, copy)
    log = workdir / f"start-{workers}.log"
    log.write_text("")
    port = free_port()
    began = time.perf_counter()
    proc = start_heartbeat(port, workers, ["--persistence", str(copy), "--log-level", "INFO"], timeout=300, log=log)
    try:
        probe = Client("probe")
        probe.open(port, clean=True, timeout=300)
        connack = time.perf_counter() - began
        probe.leave()
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        rss, holder = 0, 0
        for _ in range(10):  # the two seconds after: the first commit ends the devices that were online
            sizes = [p.memory_info().rss for p in tree]
            rss, holder = max(rss, sum(sizes)), max(holder, sizes[0] if workers > 1 else max(sizes))
            time.sleep(0.2)
        resumed = -1
        if resume:
            sub = Subscriber("sess-00000")
            sub.open(port, clean=False)
            drive([sub], lambda: len(sub.got) >= resume, 60, quiet=5)
            resumed = len(sub.got)
            sub.leave()
    finally:
        stop(proc, timeout=120)
    text = log.read_text()
    found = _RESTORED.search(text)
    restored = None if found is None else (int(found[1]), int(found[2]), int(found[3]), int(found[4]))
    copy.unlink(missing_ok=True)
    for extra in ("-wal", "-shm"):
        Path(f"{copy}{extra}").unlink(missing_ok=True)
    return Started(connack, rss, holder, restored, float(found[5]) if found else 0.0, resumed)
