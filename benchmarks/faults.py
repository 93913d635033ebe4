"""Presence under faults, at scale, on one machine (the local coordinator).

    python -m benchmarks.faults [--devices 16000] [--workers 2] [--subscribers 4] [--pages 4] [--listeners 2]

Starts ``servers.heartbeat`` with ``--workers`` workers, connects ``--devices``
raw MQTT devices (keep-alive 300 s, so nothing expires on its own) and a few
``$SYS/presence/#`` subscribers, then, one after the other:

1. SIGKILLs the worker holding the most devices: how long until the last of its
   devices' ``worker-lost`` events is in the presence log and at the subscribers on
   the other workers; every one exactly once, none for another worker's device;
2. SIGTERMs the server: how long until every subscriber has heard every remaining
   device's ``shutdown`` (before its own connection closed), and the exit code.

Then it checks the whole log: one offline event per session, and the history per
device (:mod:`loadtest.history`: no end without a start, no overlap). With ``--pages``,
that many operator's pages (live streams) watch the workers' status ports throughout,
and the drill checks what they showed: a snapshot a second on the surviving workers
through the kill, and the lost devices counted ``worker-lost`` by the box's registry.
With ``--listeners N`` the server has N listeners (``--listener``) and the devices
come through them in turn: every event must name the listener its device came through.
With ``--bridge`` the server bridges its presence to a real Mosquitto (``--bridge``,
``topic # out 1 $SYS/presence/ edge/presence/``, run by worker 0, which the kill may
take with it): after the kill, the remote's retained presence must become the edge's,
every device's last session, status and reason.
Loopback only; the server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

from loadtest.history import check_history
from loadtest.mqtt_frames import frames
from loadtest.mqtt_targets import PeerUnavailable, start_mosquitto
from loadtest.page import Watcher, fetch
from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX

from .bridge_presence import bridge_url, converged


def _connect(port: int, client_id: str, keep_alive: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(encoders.encode_connect(client_id, keep_alive=keep_alive))
    return sock


class Listener:
    """A raw subscriber; a thread counts the presence events it receives."""

    def __init__(self, port: int, name: str) -> None:
        self.sock = _connect(port, name, 0)
        self.sock.recv(4)
        self.sock.sendall(encoders.encode_subscribe(1, [(DEFAULT_PRESENCE_PREFIX + "#", 0)]))
        self.events: list[tuple[float, dict[str, object]]] = []
        self.closed_at = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = bytearray()
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.closed_at = time.monotonic()
                return
            buf += data
            found, used = frames(buf)
            for first, start, end in found:
                if first >> 4 == 3:
                    tlen = int.from_bytes(buf[start : start + 2], "big")
                    topic = buf[start + 2 : start + 2 + tlen].decode()
                    if topic.startswith(DEFAULT_PRESENCE_PREFIX):
                        self.events.append((time.monotonic(), json.loads(buf[start + 2 + tlen : end])))
            del buf[:used]


def _log(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(
    devices: int,
    workers: int,
    subscribers: int,
    pages: int = 0,
    doors: int = 1,
    bridge: bool = False,
    victim: int | None = None,
) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="ik-faults-"))
    log = work / "presence.jsonl"
    port = free_port()
    ports = [port] + [free_port() for _ in range(doors - 1)]
    extra = ["--tick", "0.1", "--presence-log", str(log)]
    # Mosquitto's default queue would drop a burst of presence on the way in.
    remote = start_mosquitto("bridge-remote", free_port(), "max_queued_messages 0\n") if bridge else None
    rport = 0 if remote is None else remote.port
    if bridge:
        extra += ["--bridge", bridge_url(rport)]
    for more in ports[1:]:
        extra += ["--listener", f"mqtt://127.0.0.1:{more}"]
    status = 0
    if pages:  # the status ports only where pages watch them
        status = free_port(run=workers)
        extra += ["--status-port", str(status)]
    proc = start_heartbeat(port, workers, extra)
    socks: list[socket.socket] = []
    watching = threading.Event()
    watchers = [Watcher(status + i % workers) for i in range(pages)]
    try:
        listeners = [Listener(port, f"sub-{i}") for i in range(subscribers)]
        for i in range(devices):
            socks.append(_connect(ports[i % doors], f"dev-{i}", 300))
        for s in socks:
            s.recv(4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            online = {e["client_id"]: e for e in _log(log) if e["status"] == "online"}
            if len(online) >= devices + subscribers + bridge:  # and the bridge's own client
                break
            time.sleep(0.2)
        for w in watchers:
            threading.Thread(target=w.run, args=(watching,), daemon=True).start()
        time.sleep(2.0 if watchers else 0.0)  # every page has its first snapshots
        epochs = {str(e["client_id"]): str(e["epoch"]) for e in online.values()}
        by_worker = collections.Counter(int(str(e["worker"])) for e in online.values())
        sub_workers = {int(str(online[f"sub-{i}"]["worker"])) for i in range(len(listeners))}
        # The kernel may put every subscriber on one worker: the victim must leave one
        # listening elsewhere, or nobody is there to hear the worker-lost events.
        candidates = [w for w, _ in by_worker.most_common() if sub_workers - {w}] or [by_worker.most_common(1)[0][0]]
        victim = victim if victim in candidates else candidates[0]
        pid = int(next(ep for ep in epochs.values() if ep.startswith(f"{victim}.")).split(".")[1])
        lost = {c for c, e in online.items() if int(str(e["worker"])) == victim}
        ours = {f"dev-{i}" for i in range(devices)} | {f"sub-{i}" for i in range(subscribers)}
        others = [li for li in listeners if int(str(online[f"sub-{listeners.index(li)}"]["worker"])) != victim]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        heard_all = in_log = float("nan")
        while time.monotonic() < deadline:
            # Counted in bytes, not parsed: parsing the whole log each round would take the
            # subscriber threads' time (one GIL) and inflate what they measure.
            if in_log != in_log and log.read_bytes().count(b'"worker-lost"') >= len(lost):
                in_log = time.monotonic()
            if (
                in_log == in_log
                and others
                and all(
                    len({str(e["client_id"]) for _, e in li.events if e.get("reason") == "worker-lost"}) >= len(lost)
                    for li in others
                )
            ):
                heard_all = max(max(t for t, e in li.events if e.get("reason") == "worker-lost") for li in others)
                break
            time.sleep(0.05)
        log_lost = [e for e in _log(log) if e.get("reason") == "worker-lost"]
        time.sleep(2.0)  # the restarted worker settles
        page: dict[str, object] = {}
        if watchers:
            survivors = [w for w in watchers if w.port != status + victim]
            snapshot = fetch(survivors[0].port, "/presence.json?limit=0")
            registry = snapshot["registry"] or {}
            page = {
                "page_worker_lost": registry.get("ends", {}).get("worker-lost", 0),
                "page_online": registry.get("online"),
                # The bridge's own local client is online too, back after the kill if it was lost.
                "page_expected_online": devices + subscribers - len(lost & ours) + bridge,
                "page_longest_gap_s": round(max(w.longest_gap(killed, time.monotonic()) for w in survivors), 2),
                "page_streams_failed": [w.failed for w in survivors if w.failed],
            }
            watching.set()
            for w in watchers:
                w.close()
        bridged: dict[str, object] = {}
        if remote is not None:

            def truth() -> dict[str, dict[str, object]]:
                return {str(e["client_id"]): e for e in _log(log) if str(e["client_id"]).startswith("dev-")}

            right = trio.run(converged, rport, truth, 60.0)
            bridged["bridge_remote_right_after_s"] = None if right is None else round(time.monotonic() - killed, 2)
            bridged["bridge_worker_killed"] = victim == 0  # worker 0 runs the bridge
        remaining = {f"dev-{i}" for i in range(devices)} - lost
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - stopped
        done = []
        for li in others:
            heard = {str(e["client_id"]) for _, e in li.events if e.get("reason") == "shutdown"}
            done.append(heard >= remaining)
        sessions: dict[str, int] = collections.Counter()
        for e in _log(log):
            if e.get("status") == "offline" and e.get("epoch"):
                sessions[str(e["epoch"])] += 1
        started = {str(e["epoch"]) for e in _log(log) if e.get("status") == "online"}
        # No device reconnects here, so no two sessions of one may overlap at all.
        history = check_history(_log(log), lease=0.0)
        came = {f"dev-{i}": f"mqtt://127.0.0.1:{ports[i % doors]}" for i in range(devices)}
        misnamed = [
            e for e in _log(log) if e.get("client_id") in came and e.get("listener") != came[str(e["client_id"])]
        ]
        return {
            "devices": devices,
            "workers": workers,
            "killed_worker_devices": len(lost),
            "worker_lost_in_log": len(log_lost),
            "worker_lost_unique": len({str(e["client_id"]) for e in log_lost}),
            "worker_lost_wrong": sum(str(e["client_id"]) not in lost for e in log_lost),
            "worker_lost_in_log_s": round(in_log - killed, 3),
            "worker_lost_at_subscribers_s": round(heard_all - killed, 3),
            "sigterm_exit_s": round(exit_s, 2),
            "exit_code": code,
            "subscribers_heard_every_shutdown": all(done),
            "sessions": len(started),
            "sessions_without_offline": len(started - set(sessions)),
            "sessions_with_several_offline": sum(n > 1 for n in sessions.values()),
            "history": history.summary(examples=3),
            "history_ok": history.ok,
            "listeners": doors,
            "events_naming_another_listener": len(misnamed),
            **page,
            **bridged,
        }
    finally:
        watching.set()
        for w in watchers:
            w.close()
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()  # by PID
            proc.wait()
        if remote is not None:
            remote.stop()  # by PID


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=16_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--subscribers", type=int, default=4)
    p.add_argument("--pages", type=int, default=0, help="live operator's pages watching the workers throughout")
    p.add_argument("--listeners", type=int, default=1, help="listeners the devices come through in turn")
    p.add_argument("--bridge", action="store_true", help="bridge presence to a real Mosquitto and check its view")
    p.add_argument("--victim", type=int, default=None, help="the worker to kill (if a subscriber is elsewhere)")
    args = p.parse_args(argv)
    doors = max(1, args.listeners)
    try:
        result = run(args.devices, args.workers, args.subscribers, args.pages, doors, args.bridge, args.victim)
    except PeerUnavailable as exc:
        print(f"python -m benchmarks.faults: --bridge: {exc}", file=sys.stderr)
        return 2
    for key, value in result.items():
        print(f"{key:38} {value}")
    ok = (
        result["worker_lost_in_log"] == result["killed_worker_devices"] == result["worker_lost_unique"]
        and result["worker_lost_wrong"] == 0
        and result["sessions_without_offline"] == 0
        and result["sessions_with_several_offline"] == 0
        and result["history_ok"]
        and result["events_naming_another_listener"] == 0
        and result["exit_code"] == 0
        and result["subscribers_heard_every_shutdown"]
        and (not args.bridge or result["bridge_remote_right_after_s"] is not None)
        and (
            not args.pages
            or (
                result["page_worker_lost"] == result["killed_worker_devices"]
                and result["page_online"] == result["page_expected_online"]
                and float(str(result["page_longest_gap_s"])) <= 2.0
                and not result["page_streams_failed"]
            )
        )
    )
    print("result".ljust(38), "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
