"""Presence upstream through the bridge (issue 64): after the link comes back, how long
until the remote's retained ``$SYS/presence/#`` is the edge's truth again?

The edge is this server (``python -m servers.heartbeat --workers 1``) in a subprocess
with ``--bridge mqtt://127.0.0.1:RPORT/edge?topic=$SYS/presence/%23%20out%201``; the
remote is a real Mosquitto. Devices are raw MQTT 3.1.1 sockets in this process, pinging
every half keep-alive. Steps, each bounded:

1. every device connects; wait until the remote's view has them all online;
2. SIGSTOP the remote (it keeps its retained store) and wait until the edge's
   notification topic says ``0``;
3. a tenth of the devices go silent; wait until the edge has them all offline
   (keepalive-timeout at 1.5 x keep-alive);
4. SIGCONT the remote; the edge's notification topic says ``1`` again (the bridge's
   return) and we time until the remote's view (a subscriber there, then a fresh
   retained read to confirm the store) matches the edge's payload for every device.

``python -m benchmarks.bridge_presence --devices 10000 --keep-alive 30 --json out.json``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from loadtest.mqtt_targets import mosquitto_binary
from loadtest.processes import free_port, stop, wait_listening
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.client import MQTT_311, ClientOptions, ClientSession, Message

ROOT = Path(__file__).resolve().parent.parent
PRESENCE = "$SYS/presence/"
REMOTE = "edge/presence/"
"""Where the presence goes on the remote: Mosquitto denies every client's (and so a
bridge's) PUBLISH to ``$SYS/...`` but ``$SYS/broker/connection/...``, so a bridge to it
maps the prefix (``topic # out 1 $SYS/presence/ edge/presence/``)."""
STATE = "$SYS/broker/connection/"
PREFIX = "dev-"

CONF = """\
{user}listener {port} 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 0
"""


def bridge_url(remote_port: int, keepalive: int = 5) -> str:
    """The ``--bridge`` URL: ``# out 1 $SYS/presence/ edge/presence/``, blanks as ``%20``,
    ``#`` as ``%23``, ``$`` as ``%24``."""
    topic = "%23%20out%201%20%24SYS/presence/%20edge/presence/"
    query = f"topic={topic}&keepalive_interval={keepalive}&restart_timeout=1"
    return f"mqtt://127.0.0.1:{remote_port}/edge?{query}"


class Watcher:
    """A subscriber (keep-alive 0) that keeps the last payload of every topic it sees."""

    def __init__(self, name: str, *filters: str, prefix: str = PRESENCE) -> None:
        self.prefix = prefix
        self.session = ClientSession(ClientOptions(name, MQTT_311, keep_alive=0, window=100))
        self.filters = filters
        self.last: dict[str, bytes] = {}
        self.seen: list[tuple[float, str, bytes]] = []  # (trio time, topic, payload) of the non-presence ones
        self.changed = trio.Event()
        self.stream: trio.SocketStream | None = None

    async def run(self, port: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.stream = await trio.open_tcp_stream("127.0.0.1", port)
        self.session.connect()
        self.session.subscribe([(f, 1) for f in self.filters])
        await self._flush()
        task_status.started()
        try:
            while data := await self.stream.receive_some(1 << 16):
                for event in self.session.receive_data(data):
                    if isinstance(event, Message):
                        self.last[event.topic] = event.payload
                        if not event.topic.startswith(self.prefix):
                            self.seen.append((trio.current_time(), event.topic, event.payload))
                        self.changed.set()
                await self._flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _flush(self) -> None:
        data = self.session.bytes_to_send()
        if data and self.stream is not None:
            await self.stream.send_all(data)

    def devices(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for topic, payload in self.last.items():
            name = topic[len(self.prefix) :]
            if topic.startswith(self.prefix) and name.startswith(PREFIX) and payload:
                out[name] = json.loads(payload)
        return out

    async def until(self, check: Callable[[], bool], seconds: float) -> None:
        with trio.fail_after(seconds):
            while not check():
                self.changed = trio.Event()
                with trio.move_on_after(0.2):
                    await self.changed.wait()


async def retained_view(port: int, expected: int, seconds: float = 10.0) -> dict[str, dict[str, Any]]:
    """A fresh subscriber's retained presence on the remote at ``port`` (devices only):
    what came within ``seconds`` (all ``expected`` of them, or less)."""
    watcher = Watcher(f"reader-{time.monotonic_ns()}", f"{REMOTE}#", prefix=REMOTE)
    async with trio.open_nursery() as nursery:
        await nursery.start(watcher.run, port)
        with trio.move_on_after(seconds):
            await watcher.until(lambda: len(watcher.devices()) >= expected, seconds + 1)
        await trio.sleep(0.3)  # nothing more comes
        nursery.cancel_scope.cancel()
    return watcher.devices()


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(got.get(k) == want.get(k) for k in ("epoch", "status", "reason"))


async def converged(port: int, truth: Callable[[], dict[str, dict[str, Any]]], seconds: float) -> float | None:
    """Seconds until a fresh retained read of the remote at ``port`` is ``truth()`` (each
    device's last event as the edge has it: the same session, status and reason), read
    again every second; None if not within ``seconds``."""
    start = trio.current_time()
    while trio.current_time() - start < seconds:
        want = truth()
        got = await retained_view(port, len(want), 2.0)
        if set(got) == set(want) and all(_same(got[k], v) for k, v in want.items()):
            return trio.current_time() - start
        await trio.sleep(1.0)
    return None


@dataclass
class Devices:
    count: int
    keep_alive: int
    silent: set[str] = field(default_factory=set)
    broken: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [f"{PREFIX}{n:05d}" for n in range(self.count)]

    async def one(self, name: str, limit: trio.Semaphore, connected: list[str]) -> None:
        async with limit:
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            await stream.send_all(encoders.encode_connect(name, keep_alive=self.keep_alive))
            got = b""
            with trio.fail_after(30):
                while len(got) < 4:
                    data = await stream.receive_some(4 - len(got))
                    assert data, f"{name}: closed before its CONNACK"
                    got += data
            assert got == encoders.encode_connack(False, 0), (name, got)
        connected.append(name)
        if len(connected) == self.count:
            self.all_connected.set()
        try:
            while name not in self.silent:
                await trio.sleep(self.keep_alive / 2)
                if name not in self.silent:
                    await stream.send_all(encoders.encode_pingreq())  # the PINGRESPs wait unread
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.broken.append(name)
            return
        await trio.sleep_forever()  # silent: the socket stays open, the edge times it out

    port: int = 0
    all_connected: trio.Event = field(default_factory=trio.Event)


@dataclass
class Result:
    devices: int
    keep_alive: int
    silent: int
    connect_seconds: float
    link_down_seconds: float
    bridge_return_seconds: float
    converge_seconds: float | None
    within_keep_alive: bool
    live_mismatches: int
    retained_online_before: int
    retained_after: int
    retained_correct: bool
    mismatches: int
    edge_notifications: list[str]
    broken_devices: int


def expected_right(edge: dict[str, dict[str, Any]], remote: dict[str, dict[str, Any]], silent: set[str]) -> int:
    """How many devices the remote view has wrong (its payload is not the edge's, or the
    edge's is not what it should be)."""
    wrong = 0
    for name, mine in edge.items():
        truth = ("offline", "keepalive-timeout") if name in silent else ("online", None)
        wrong += (mine.get("status"), mine.get("reason")) != truth or remote.get(name) != mine
    return wrong + len(set(remote) - set(edge))


def _popen(argv: list[str]) -> subprocess.Popen[bytes]:
    quiet = subprocess.DEVNULL
    return subprocess.Popen(argv, cwd=ROOT, stdout=quiet, stderr=quiet)


async def measure(count: int, keep_alive: int, fraction: float = 0.1, bridge_keepalive: int = 5) -> Result:
    binary = mosquitto_binary()
    if binary is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
    with tempfile.TemporaryDirectory() as tmp:
        rport, port = free_port(), free_port()
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(CONF.format(user="user root\n" if os.geteuid() == 0 else "", port=rport))
        remote = await trio.to_thread.run_sync(_popen, [binary, "-c", str(conf)])
        edge: subprocess.Popen[bytes] | None = None
        try:
            await trio.to_thread.run_sync(wait_listening, rport, remote)
            argv = [sys.executable, "-m", "servers.heartbeat", "--workers", "1", "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--bridge", bridge_url(rport, bridge_keepalive)]
            edge = await trio.to_thread.run_sync(_popen, argv)
            await trio.to_thread.run_sync(wait_listening, port, edge)
            return await _scenario(remote, port, rport, count, keep_alive, fraction, bridge_keepalive)
        finally:
            remote.send_signal(signal.SIGCONT)
            if edge is not None:
                stop(edge)
            stop(remote)


async def _scenario(
    remote: subprocess.Popen[bytes], port: int, rport: int, count: int, keep_alive: int, fraction: float, bk: int
) -> Result:
    devices = Devices(count, keep_alive, port=port)
    names = devices.names()
    silent = set(names[:: max(1, round(1 / fraction))]) if fraction else set()
    here = Watcher("edge-watcher", f"{PRESENCE}#", f"{STATE}#")
    there = Watcher("remote-watcher", f"{REMOTE}#", prefix=REMOTE)
    async with trio.open_nursery() as nursery:
        await nursery.start(here.run, port)
        await here.until(lambda: (here.seen and here.seen[-1][2] == b"1") is True, 20)
        await nursery.start(there.run, rport)
        connected: list[str] = []
        limit = trio.Semaphore(200)
        start = trio.current_time()
        for name in names:
            nursery.start_soon(devices.one, name, limit, connected)
        with trio.fail_after(120):
            await devices.all_connected.wait()
        connect_seconds = trio.current_time() - start

        def all_online(view: Watcher) -> bool:
            seen = view.devices()
            return len(seen) == count and all(v.get("status") == "online" for v in seen.values())

        await there.until(lambda: all_online(there), 120)
        before = await retained_view(rport, count)
        retained_online = sum(v.get("status") == "online" for v in before.values())
        # 2. The link goes down: the remote is stopped, keeping its retained store.
        remote.send_signal(signal.SIGSTOP)
        stopped = trio.current_time()
        await here.until(lambda: here.seen[-1][2] == b"0", 1.5 * bk + 10)
        # 3. A tenth go silent; the edge times them out meanwhile.
        devices.silent |= silent

        def edge_has_them_offline() -> bool:
            seen = here.devices()
            return all(seen.get(n, {}).get("status") == "offline" for n in silent)

        await here.until(edge_has_them_offline, 1.5 * keep_alive + keep_alive / 2 + 15)
        # 4. The link comes back.
        remote.send_signal(signal.SIGCONT)
        resumed = trio.current_time()
        link_down = resumed - stopped
        await here.until(lambda: here.seen[-1][2] == b"1", 30)
        back = next(t for t, _, p in reversed(here.seen) if p == b"1")
        converged: float | None = None
        with trio.move_on_after(max(30.0, 2.0 * keep_alive)):  # bounded: it may never converge
            await there.until(lambda: expected_right(here.devices(), there.devices(), silent) == 0, 3600)
            converged = trio.current_time() - back
        live_mismatches = expected_right(here.devices(), there.devices(), silent)
        stored = await retained_view(rport, count)
        mismatches = expected_right(here.devices(), stored, silent)
        notes = [p.decode() for _, t, p in here.seen if t.startswith(STATE)]
        nursery.cancel_scope.cancel()
    return Result(
        devices=count,
        keep_alive=keep_alive,
        silent=len(silent),
        connect_seconds=round(connect_seconds, 3),
        link_down_seconds=round(link_down, 3),
        bridge_return_seconds=round(back - resumed, 3),
        converge_seconds=None if converged is None else round(converged, 3),
        within_keep_alive=converged is not None and converged <= keep_alive,
        live_mismatches=live_mismatches,
        retained_online_before=retained_online,
        retained_after=len(stored),
        retained_correct=mismatches == 0,
        mismatches=mismatches,
        edge_notifications=notes,
        broken_devices=len(devices.broken),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--keep-alive", type=int, default=30)
    parser.add_argument("--silent-fraction", type=float, default=0.1)
    parser.add_argument("--bridge-keepalive", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = trio.run(measure, args.devices, args.keep_alive, args.silent_fraction, args.bridge_keepalive)
    print(json.dumps(asdict(result), indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0 if result.within_keep_alive and result.retained_correct and not result.broken_devices else 1


if __name__ == "__main__":
    sys.exit(main())
