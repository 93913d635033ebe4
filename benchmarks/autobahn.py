"""The Autobahn|Testsuite WebSocket cases against ``servers.http``, driven by kosoku.

    python -m benchmarks.autobahn [--engine dense,streams] [--case GLOB ...] [--exclude GLOB ...]
                                  [--outdir DIR] [--parallelism N] [--timeout S]

Autobahn's fuzzing client runs each case on a connection of its own to a server
that echoes (``loadtest.asgi_app``, text as text and bytes as bytes) and grades what
comes back: OK, NON-STRICT (conformant, short of a SHOULD), INFORMATIONAL (the spec
leaves it open), UNIMPLEMENTED, or FAILED. kosoku (on PyPI) runs Autobahn's own case
files on Python 3, natively; it writes Autobahn's report (``index.json`` and
``index.html`` and one JSON and HTML file a case) under ``--outdir``, which is read
back here.

One ``python -m servers.http`` process per engine, on a free loopback port, with
the server's defaults but for ``--ws-ping-interval 0``: a case counts a ping from
the server as an event it did not expect (the compression cases end at the first
one, as FAILED), and the server's 20 s ping comes in the middle of the longest
cases. Every case is run unless ``--case`` names some; the whole set (517 cases)
takes 10 to 15 minutes an engine two at a time (``--parallelism 2``), nearly all of
it in the compression cases (12.x, 13.x: 1,000 messages of up to 128 KiB each, in
frames of 256 bytes for some). Exit status 1 if any case failed (see :func:`failures`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.processes import free_port, start_http, stop

__all__ = [
    "CATEGORIES",
    "SUBSET",
    "Outcome",
    "Run",
    "failures",
    "kosoku_command",
    "read_report",
    "run_engine",
    "summary",
]

ROOT = Path(__file__).resolve().parent.parent
APP = "loadtest.asgi_app:app"
SERVER_ARGS = ("--ws-ping-interval", "0")
"""The server's defaults, but no pings: a case takes a ping from the server for an
event it did not expect."""

CATEGORIES = {
    "1": "Framing",
    "2": "Pings/Pongs",
    "3": "Reserved Bits",
    "4": "Opcodes",
    "5": "Fragmentation",
    "6": "UTF-8 Handling",
    "7": "Close Handling",
    "9": "Limits/Performance",
    "10": "Miscellaneous",
    "12": "Compression (payloads)",
    "13": "Compression (parameters)",
}

# The verdicts in the order a summary shows them (Autobahn's labels).
VERDICTS = ("OK", "NON-STRICT", "INFORMATIONAL", "UNIMPLEMENTED", "FAILED")
# Closing-handshake verdicts that pass (kosoku's own test of a passed case).
_CLOSE_PASSES = frozenset({"OK", "INFORMATIONAL"})
# The compression categories, which our server implements: UNIMPLEMENTED there
# would mean permessage-deflate was not taken.
_COMPRESSION = frozenset({"12", "13"})

SUBSET = (
    # Framing, pings, reserved bits, opcodes, fragmentation, UTF-8, closing,
    # miscellaneous: every case (a few seconds in all, most of it 6.4's pauses).
    "1.*",
    "2.*",
    "3.*",
    "4.*",
    "5.*",
    "6.*",
    "7.*",
    "10.*",
    # Limits: the smallest case of each group (64 KiB messages, 4 MiB in fragments of
    # 4 MiB, 1 MiB in chops of 64 KiB, a round trip of empty messages).
    "9.1.1",
    "9.2.1",
    "9.3.9",
    "9.4.9",
    "9.5.6",
    "9.6.6",
    "9.7.1",
    "9.8.1",
    # Compression: 1,000 small messages of each payload (12.x.1), one payload
    # fragmented (12.1.11); each parameter set of the client's and the server's (13.x.1),
    # and fragmented under the smallest window with no context takeover (13.5.11).
    # Named one by one: kosoku's "12.*.1" also takes 12.x.10 to 12.x.18, the largest.
    *(f"12.{payload}.1" for payload in range(1, 6)),
    "12.1.11",
    *(f"13.{params}.1" for params in range(1, 8)),
    "13.5.11",
)
"""Case ids and globs for a run that fits the test suite: every category, the cheap cases."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One case as Autobahn graded it."""

    case: str
    """The case id, as ``"12.3.15"``."""
    behavior: str
    """The verdict on the messages: one of :data:`VERDICTS` (or kosoku's ERROR)."""
    behavior_close: str
    """The verdict on the closing handshake (OK, INFORMATIONAL, UNCLEAN, WRONG CODE, ...)."""
    duration_ms: int
    result: str
    """Why, in the case's words (read from its report for a case that failed)."""

    @property
    def category(self) -> str:
        """The case's major number (``"12"``)."""
        return self.case.split(".", 1)[0]


@dataclass(frozen=True, slots=True)
class Run:
    """One engine's run."""

    engine: str
    outcomes: list[Outcome]
    seconds: float
    """Wall time of the fuzzing client (the server's start not counted)."""
    command: str
    """The kosoku command line that ran the cases."""
    outdir: Path
    """Where its report is (``index.html``)."""


def _case_key(case: str) -> list[int]:
    return [int(part) for part in case.split(".")]


def kosoku_command() -> str:
    """The kosoku executable: the one installed beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name("kosoku")
    if beside.exists():
        return str(beside)
    found = shutil.which("kosoku")
    if found is None:
        raise RuntimeError("kosoku is not installed (pip install kosoku; it is in the 'test' extra)")
    return found


def read_report(outdir: Path) -> list[Outcome]:
    """The outcomes in an Autobahn report directory (its ``index.json``), in case order."""
    index = json.loads((outdir / "index.json").read_text())
    outcomes = []
    for cases in index.values():  # one agent: the server under test
        for case, entry in cases.items():
            result = ""
            if not _passed(case, entry["behavior"], entry["behaviorClose"]):
                # Only a failed case's own report is opened, for its reason.
                detail = json.loads((outdir / entry["reportfile"]).read_text())
                result = f"{detail.get('result', '')} / {detail.get('resultClose', '')}"
            outcomes.append(
                Outcome(case, entry["behavior"], entry["behaviorClose"], int(entry.get("duration", 0)), result)
            )
    return sorted(outcomes, key=lambda o: _case_key(o.case))


def _passed(case: str, behavior: str, behavior_close: str) -> bool:
    if behavior not in ("OK", "NON-STRICT", "INFORMATIONAL", "UNIMPLEMENTED"):
        return False  # FAILED, or a case kosoku could not run to a verdict (ERROR)
    if behavior == "UNIMPLEMENTED" and case.split(".", 1)[0] in _COMPRESSION:
        return False
    return behavior_close in _CLOSE_PASSES


def failures(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The cases that fail: behaviour FAILED (or never graded), a closing handshake
    graded worse than INFORMATIONAL, or a compression case UNIMPLEMENTED."""
    return [o for o in outcomes if not _passed(o.case, o.behavior, o.behavior_close)]


def summary(outcomes: Sequence[Outcome]) -> str:
    """A table of verdicts by category, then the failed cases, one a line."""
    by_category: dict[str, Counter[str]] = defaultdict(Counter)
    seconds: defaultdict[str, float] = defaultdict(float)
    for o in outcomes:
        by_category[o.category][o.behavior] += 1
        seconds[o.category] += o.duration_ms / 1000
    head = ["category", "cases", *VERDICTS, "other", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    total: Counter[str] = Counter()
    for category in sorted(by_category, key=int):
        counts = by_category[category]
        total.update(counts)
        other = sum(n for verdict, n in counts.items() if verdict not in VERDICTS)
        name = f"{category} {CATEGORIES.get(category, '')}".strip()
        cells = " | ".join(str(counts[v]) for v in VERDICTS)
        lines.append(f"| {name} | {sum(counts.values())} | {cells} | {other} | {seconds[category]:.1f} |")
    other = sum(n for verdict, n in total.items() if verdict not in VERDICTS)
    cells = " | ".join(str(total[v]) for v in VERDICTS)
    lines.append(f"| all | {sum(total.values())} | {cells} | {other} | {sum(seconds.values()):.1f} |")
    for o in failures(outcomes):
        lines.append(f"FAILED {o.case}: behavior {o.behavior}, close {o.behavior_close}: {o.result}")
    return "\n".join(lines)


def run_engine(
    engine: str,
    outdir: Path,
    cases: Sequence[str] = (),
    exclude: Sequence[str] = (),
    *,
    parallelism: int = 1,
    timeout: float = 3600.0,
) -> Run:
    """Start ``servers.http`` on ``engine``, run the cases (every case if ``cases``
    is empty) against it, stop it, and read the report written to ``outdir``."""
    port = free_port()
    server = start_http(port, extra=[APP, "--engine", engine, *SERVER_ARGS], cwd=str(ROOT))
    try:
        argv = [kosoku_command(), f"ws://127.0.0.1:{port}", "-o", str(outdir), "-p", str(parallelism)]
        for glob in cases:
            argv += ["-i", glob]
        for glob in exclude:
            argv += ["-x", glob]
        started = time.monotonic()
        # kosoku exits 1 when a case fails; the report says which, and is read below.
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        seconds = time.monotonic() - started
    finally:
        stop(server)
    if not (outdir / "index.json").exists():
        raise RuntimeError(f"kosoku wrote no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    shown = " ".join(argv[1:]).replace(f"127.0.0.1:{port}", "127.0.0.1:PORT")
    return Run(engine, read_report(outdir), seconds, f"kosoku {shown}", outdir)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases on each engine, print a summary of each; 1 if any case failed."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.autobahn", description=__doc__.split("\n\n")[1])
    p.add_argument("--engine", default="dense,streams", help="comma-separated engines (default: dense,streams)")
    p.add_argument("--case", action="append", default=[], metavar="GLOB", help="cases to run (default: all)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="cases to leave out")
    p.add_argument("--subset", action="store_true", help="the test suite's cases (SUBSET) instead of all")
    p.add_argument("--outdir", type=Path, default=None, help="where the reports go (default: a temporary folder)")
    p.add_argument("--parallelism", type=int, default=1, help="cases run at once (default: 1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for one engine's run (default: 3600)")
    args = p.parse_args(argv)
    cases = list(SUBSET) if args.subset else args.case
    base = args.outdir or Path(tempfile.mkdtemp(prefix="autobahn-"))
    failed = False
    for engine in args.engine.split(","):
        run = run_engine(engine, base / engine, cases, args.exclude, parallelism=args.parallelism, timeout=args.timeout)
        print(f"{engine}: {len(run.outcomes)} cases in {run.seconds:.0f} s ({run.command}); report {run.outdir}")
        print(summary(run.outcomes))
        failed = failed or bool(failures(run.outcomes))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
