"""Presence under faults on a box that keeps its state durably (``--persistence``).

    python -m benchmarks.faults_durable [--devices 8000] [--workers 2] [--subscribers 4]

The operator's week on one box with ``--persistence FILE``: starts
``servers.heartbeat`` with ``--workers`` workers, connects ``--devices`` raw MQTT
devices (keep-alive 300 s: nothing expires on its own) and a few ``$SYS/presence/#``
subscribers, then, one after the other:

1. SIGKILLs the worker holding the most devices: each of its devices offline
   ``worker-lost``, once (the box goes on, the supervisor restarts the worker);
2. SIGSTOPs another worker for 3 s, then SIGCONT: none of its devices is ended;
3. sends hostile input (garbage, a CONNECT that lies about its length, a reserved
   packet type): only those connections end;
4. SIGTERMs the box and starts it again on the file: each device still online gets
   one ``server-shutdown``, with its session's epoch, at the start;
5. reconnects every device, then SIGKILLs the supervisor and every worker at once and
   starts the box again: each gets one ``server-lost``.

Then it checks the whole history over the three runs' logs (:mod:`loadtest.history`):
one start and one end per session, no overlap. Loopback only; every process is
stopped by its PID.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loadtest.history import check_history
from loadtest.processes import free_port, start_heartbeat

from .faults import Listener, _connect, _log

__all__ = ["run"]

_HOSTILE = (
    b"\x00\x00\x00\x00",  # packet type 0 (reserved)
    b"\x10\xff\xff\xff\x7f",  # a CONNECT claiming 256 MiB
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not MQTT at all
)


def _until(check: Callable[[], bool], limit: float) -> float:
    """Seconds until ``check()`` held (NaN: it did not within ``limit``)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if check():
            return round(time.monotonic() - start, 2)
        time.sleep(0.1)
    return float("nan")


class _Box:
    """The box's runs on one store and one port, a presence log each."""

    def __init__(self, work: Path, workers: int) -> None:
        self.work = work
        self.workers = workers
        self.port = free_port()
        self.runs: list[subprocess.Popen[str]] = []

    def log(self, n: int) -> Path:
        return self.work / f"presence-{n}.jsonl"

    def start(self) -> subprocess.Popen[str]:
        n = len(self.runs)
        extra = ["--tick", "0.1", "--presence-log", str(self.log(n)), "--persistence", str(self.work / "state.db")]
        proc = start_heartbeat(self.port, self.workers, extra, timeout=120, log=self.work / f"server-{n}.log")
        self.runs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """The supervisor's and its workers' (as it printed them, and the workers it restarted since)."""
        n = len(self.runs) - 1
        text = (self.work / f"server-{n}.log").read_text()
        found = re.search(r"workers \[([\d, ]+)\]", text)
        pids = [int(p) for p in found.group(1).split(",")] if found else []
        pids += [int(str(e["epoch"]).split(".")[1]) for e in _log(self.log(n)) if e.get("status") == "online"]
        return [self.runs[-1].pid, *sorted(set(pids))]

    def events(self) -> list[dict[str, object]]:
        return [e for n in range(len(self.runs)) for e in _log(self.log(n))]


def _ends(events: list[dict[str, object]], reason: str) -> collections.Counter[str]:
    return collections.Counter(str(e["client_id"]) for e in events if e.get("reason") == reason)


def run(devices: int, workers: int, subscribers: int) -> dict[str, object]:
    """The drill; returns what it measured and checked."""
    work = Path(tempfile.mkdtemp(prefix="ik-faults-durable-"))
    box = _Box(work, workers)
    box.start()
    names = [f"dev-{i}" for i in range(devices)]
    socks: list[socket.socket] = []
    out: dict[str, object] = {"devices": devices, "workers": workers}
    try:
        listeners = [Listener(box.port, f"sub-{i}") for i in range(subscribers)]

        def connect_all() -> None:
            for s in socks:
                s.close()
            socks[:] = [_connect(box.port, name, 300) for name in names]
            for s in socks:
                s.recv(4)

        def online(n: int) -> dict[str, dict[str, object]]:
            found: dict[str, dict[str, object]] = {}
            for e in _log(box.log(n)):
                if e["status"] == "online":
                    found[str(e["client_id"])] = e
                elif e["status"] == "offline":
                    found.pop(str(e["client_id"]), None)
            return found

        connect_all()
        out["online_s"] = _until(lambda: len(online(0)) >= devices + subscribers, 120)
        by_worker = collections.Counter(int(str(e["worker"])) for e in online(0).values())
        victim = by_worker.most_common(1)[0][0]
        held = {c: e for c, e in online(0).items() if int(str(e["worker"])) == victim}
        os.kill(int(str(next(iter(held.values()))["epoch"]).split(".")[1]), signal.SIGKILL)  # by PID
        out["worker_lost_s"] = _until(lambda: sum(_ends(_log(box.log(0)), "worker-lost").values()) >= len(held), 60)
        lost = _ends(_log(box.log(0)), "worker-lost")
        out["worker_lost_right"] = set(lost) == set(held) and max(lost.values()) == 1

        # A stall: the other worker stops for 3 s; its devices' bytes wait in the kernel.
        stalled = next(w for w in by_worker if w != victim) if len(by_worker) > 1 else None
        if stalled is not None:
            pid = next(int(str(e["epoch"]).split(".")[1]) for e in online(0).values() if e["worker"] == stalled)
            before = len(_log(box.log(0)))
            os.kill(pid, signal.SIGSTOP)  # by PID
            time.sleep(3.0)
            os.kill(pid, signal.SIGCONT)
            time.sleep(2.0)
            out["ended_by_the_stall"] = sum(e["status"] == "offline" for e in _log(box.log(0))[before:])
        for data in _HOSTILE:
            with socket.create_connection(("127.0.0.1", box.port), timeout=5) as hostile:
                hostile.sendall(data)
                with contextlib.suppress(OSError):
                    hostile.recv(64)
        time.sleep(1.0)
        up = set(online(0)) - {f"sub-{i}" for i in range(subscribers)}
        out["online_after_hostile"] = len(up)
        out["online_expected"] = devices - sum(c.startswith("dev-") for c in held)

        # A restart: SIGTERM, and the box again on its file.
        epochs = {c: str(e["epoch"]) for c, e in online(0).items()}
        stopped = time.monotonic()
        box.runs[-1].send_signal(signal.SIGTERM)  # by PID
        out["sigterm_exit_code"] = box.runs[-1].wait(timeout=120)
        out["sigterm_exit_s"] = round(time.monotonic() - stopped, 2)
        for li in listeners:
            li.sock.close()
        started = time.monotonic()
        box.start()
        out["restart_s"] = round(time.monotonic() - started, 2)
        ends = [e for e in _log(box.log(1)) if e.get("reason") == "server-shutdown"]
        out["server_shutdown_right"] = sorted(str(e["client_id"]) for e in ends) == sorted(epochs) and all(
            e["epoch"] == epochs[str(e["client_id"])] for e in ends
        )

        # A crash: every device back, then kill -9 of every process of the box at once.
        connect_all()
        _until(lambda: len(online(1)) >= devices, 120)
        epochs = {c: str(e["epoch"]) for c, e in online(1).items()}
        for pid in box.pids():
            with contextlib.suppress(ProcessLookupError):  # a worker the first kill's restart replaced
                os.kill(pid, signal.SIGKILL)  # by PID
        box.runs[-1].wait(timeout=30)
        for s in socks:
            s.close()
        socks.clear()
        box.start()
        ends = [e for e in _log(box.log(2)) if e.get("reason") == "server-lost"]
        out["server_lost_right"] = sorted(str(e["client_id"]) for e in ends) == sorted(epochs) and all(
            e["epoch"] == epochs[str(e["client_id"])] for e in ends
        )
        box.runs[-1].send_signal(signal.SIGTERM)  # by PID
        out["final_exit_code"] = box.runs[-1].wait(timeout=120)

        history = check_history(box.events(), lease=0.0)
        out["sessions"] = sum(e["status"] == "online" for e in box.events())
        out["history"] = history.summary(examples=3)
        out["history_ok"] = history.ok
        return out
    finally:
        for s in socks:
            s.close()
        for proc in box.runs:
            if proc.poll() is None:
                proc.kill()  # by PID
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the drill and print what it found; exit 1 if anything is wrong."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults_durable", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--subscribers", type=int, default=4)
    args = p.parse_args(argv)
    result = run(args.devices, args.workers, args.subscribers)
    for key, value in result.items():
        print(f"{key:38} {value}")
    ok = (
        result["worker_lost_right"] is True
        and result.get("ended_by_the_stall", 0) == 0
        and result["online_after_hostile"] == result["online_expected"]
        and result["sigterm_exit_code"] == 0
        and result["server_shutdown_right"] is True
        and result["server_lost_right"] is True
        and result["final_exit_code"] == 0
        and result["history_ok"] is True
    )
    print("result".ljust(38), "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
