"""What an operator reads after a mistake or a bad day (issue 61): each case run as the
operator ran it, on one or more source trees side by side, and measured by what reaches
the terminal: the exit code, the lines on stderr, whether one is a traceback, and how
long the command took to give up (a case still running at ``--limit`` seconds is
stopped by its PID and counted as "ran on").

    python -m benchmarks.operator_errors --roots /tmp/before,.

The cases are the issue's: a value out of range or unparseable, a prefix of an option
taken for it, a missing or bad file, a port taken by another program, and workers that
can never start (an app whose start-up fails, under two workers).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FAILING_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})
"""


@dataclass(frozen=True)
class Outcome:
    """What one case gave on one tree."""

    code: int | None
    """Exit code (None: still running at the limit, stopped)."""
    lines: int
    traceback: bool
    seconds: float
    first: str


def cases(workdir: Path, taken: int) -> list[tuple[str, list[str]]]:
    """(name, argv after ``python -m``) for every case."""
    (workdir / "acl").write_text("user alice\ntopic readwrite a/#\nfrobnicate\n")
    (workdir / "badapp.py").write_text(_FAILING_APP)
    mqtt = ["servers.heartbeat", "--port", "0"]
    http = ["servers.http", "--port", "0"]
    return [
        ("http --keep-alive-timeout 0", [*http, "--keep-alive-timeout", "0"]),
        ("--tick 0", [*mqtt, "--tick", "0"]),
        ("--port 70000", ["servers.heartbeat", "--port", "70000"]),
        ("--log-level LOUD", [*mqtt, "--log-level", "LOUD"]),
        ("--host 999.1.1.1", [*mqtt, "--host", "999.1.1.1"]),
        ("--workers 0", [*mqtt, "--workers", "0"]),
        ("--keepalive 10 (a prefix)", [*mqtt, "--keepalive", "10"]),
        ("--status-port taken", [*mqtt, "--status-port", str(taken)]),
        ("--ws-port taken", [*mqtt, "--ws-port", str(taken)]),
        ("--auth-file missing", [*mqtt, "--auth-file", str(workdir / "missing")]),
        ("--acl-file bad line 3", [*mqtt, "--acl-file", str(workdir / "acl")]),
        ("--tls-cert missing", [*mqtt, "--tls-cert", str(workdir / "c.pem"), "--tls-key", str(workdir / "k.pem")]),
        ("--workers 2 --status-port 0", [*mqtt, "--workers", "2", "--status-port", "0"]),
        ("http app start-up fails, 2 workers", [*http, "--workers", "2", "badapp:app"]),
    ]


def run_case(root: Path, argv: list[str], workdir: Path, limit: float) -> Outcome:
    """``python -m argv`` from ``root``, its own tree first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(workdir)])}
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True
        )
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
            proc.send_signal(signal.SIGTERM)  # by PID, and its workers with it
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        seconds = time.monotonic() - started
        err.seek(0)
        text = err.read()
    lines = [line for line in text.splitlines() if line.strip()]
    return Outcome(code, len(lines), "Traceback" in text, seconds, lines[0][:70] if lines else "")


def main(argv: list[str] | None = None) -> int:
    """Run every case on every root; print the table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.operator_errors", description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", default=str(ROOT), help="comma-separated source trees (default: this one)")
    p.add_argument("--limit", type=float, default=10.0, help="seconds before a case that runs on is stopped")
    args = p.parse_args(argv)
    roots = [Path(r).resolve() for r in args.roots.split(",")]
    held = socket.create_server(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp, held:
        workdir = Path(tmp)
        print(f"{'case':36} " + " ".join(f"{'tree ' + str(i):>26}" for i in range(len(roots))))
        print(f"{'':36} " + " ".join(f"{'exit lines tb  seconds':>26}" for _ in roots))
        for name, case in cases(workdir, taken):
            cells = []
            for root in roots:
                o = run_case(root, case, workdir, args.limit)
                code = "ran" if o.code is None else str(o.code)
                cells.append(f"{code:>4} {o.lines:>5} {'yes' if o.traceback else 'no':>3} {o.seconds:>8.1f}")
            print(f"{name:36} " + " ".join(f"{c:>26}" for c in cells), flush=True)
    for i, root in enumerate(roots):
        print(f"tree {i}: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
