"""``python -m loadtest history``: check presence logs as one history (:mod:`.history`).

    python -m loadtest history presence.jsonl [more.jsonl ...] [--lease 10] [--incomplete] [--reclaimed] [--json FILE]

Each file is a presence log as the heartbeat server writes it (``--presence-log``,
one JSON event a line); the logs of several workers or gateways are merged by their
events' time stamps, each file's own order kept among equal stamps. Exits 1 if any
violation is found, 2 if a file cannot be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .device_results import read_presence_log
from .history import check_history, merged_by_time
from .options import command_parser
from .report import write_json

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Check the logs given; exit 0 only if the history keeps every promise."""
    p = command_parser("python -m loadtest history", __doc__)
    p.add_argument("logs", nargs="+", type=Path, help="presence logs (JSON lines)")
    p.add_argument(
        "--lease", type=float, default=0.0, help="seconds two sessions of one device may both be online (default: 0)"
    )
    p.add_argument(
        "--incomplete", action="store_true", help="the servers were still running: a session without an end is fine"
    )
    p.add_argument(
        "--reclaimed",
        action="store_true",
        help="an online repeated word for word is a session announced again, not a second start: "
        "a gateway that restarted, or one whose Redis came back empty under more sessions than its "
        "reader remembers (16,384), may log one (default: a second online is a violation)",
    )
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    logs = []
    for path in args.logs:
        events = read_presence_log(path)
        if events is None:
            print(f"history: cannot read {path}")
            return 2
        logs.append([e for e in events if isinstance(e, dict)])
    # A gateway passes over a session's second online (issue 66): a copy in its log is
    # a violation unless the operator says the run had a cause for one.
    report = check_history(
        merged_by_time(*logs), lease=args.lease, complete=not args.incomplete, reannounced_copies=args.reclaimed
    )
    print(report.summary())
    if args.json:
        write_json(args.json, report.as_dict())
    return 0 if report.ok else 1
