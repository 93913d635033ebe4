"""``python -m benchmarks.bridge``: see :mod:`benchmarks.bridge`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from loadtest.mqtt_targets import mosquitto_binary

from . import brokers, runs


def _positive(kind: type[int] | type[float], low: float, high: float) -> Any:
    def parse(text: str) -> int | float:
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"between {low} and {high}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bridge", description=__doc__)
    ap.add_argument("--qos0", type=_positive(int, 1, 200_000), default=20_000, help="QoS 0 messages (20000)")
    ap.add_argument("--qos1", type=_positive(int, 1, 100_000), default=5_000, help="QoS 1 messages (5000)")
    ap.add_argument("--window", type=_positive(int, 1, 1000), default=50, help="QoS 1 PUBLISHes in flight (50)")
    ap.add_argument(
        "--keepalive",
        type=_positive(int, 5, 60),
        default=5,
        help="the bridges' keepalive_interval (5, the least both take)",
    )
    ap.add_argument("--restart-messages", type=_positive(int, 3, 50_000), default=3000, help="QoS 1 messages (3000)")
    ap.add_argument("--restart-rate", type=_positive(float, 1, 10_000), default=500.0, help="their rate a second (500)")
    ap.add_argument("--timeout", type=_positive(float, 5, 600), default=90.0, help="seconds, each part at most (90)")
    ap.add_argument(
        "--max-queued",
        type=_positive(int, 0, 1_000_000),
        default=1000,
        help="the edges' QoS 1 queue per client (--max-queued, max_queued_messages; both default to 1000)",
    )
    ap.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    return ap


async def measure(args: argparse.Namespace, binary: str, workdir: Path) -> dict[str, Any]:
    counts = {0: args.qos0, 1: args.qos1}
    figures: dict[str, Any] = {"throughput": {}, "stopped_remote": {}, "restart": {}}
    for kind in brokers.KINDS:
        figures["throughput"][kind] = await runs.throughput(
            kind, binary, workdir, counts, args.window, args.timeout, args.max_queued
        )
    figures["stopped_remote"] = await runs.stopped_remote(binary, workdir, args.keepalive, args.timeout)
    for kind in brokers.KINDS:
        figures["restart"][kind] = await runs.restart_under_load(
            kind, binary, workdir, args.restart_messages, args.restart_rate, args.window, args.timeout, args.max_queued
        )
    return figures


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"{ours / theirs:.2f}"


def table(figures: dict[str, Any]) -> str:
    rows = [f"{'':34} {'ours':>12} {'mosquitto':>12} {'ours/mosq':>10}"]

    def row(label: str, ours: Any, theirs: Any, ratio: bool = True) -> None:
        shown = ["-" if v is None else str(v) for v in (ours, theirs)]
        rows.append(f"{label:34} {shown[0]:>12} {shown[1]:>12} {_ratio(ours, theirs) if ratio else '':>10}")

    through, stopped, restart = figures["throughput"], figures["stopped_remote"], figures["restart"]
    for qos in ("qos0", "qos1"):
        ours, theirs = through["ours"][qos], through["mosquitto"][qos]
        row(f"{qos} messages/s ({ours['messages']})", ours["rate"], theirs["rate"])
        row(f"{qos} lost", ours["lost"], theirs["lost"], ratio=False)
    keepalive = stopped["ours"]["keepalive"]
    row(
        f"stopped remote: dropped at s (K {keepalive})", stopped["ours"]["noticed_s"], stopped["mosquitto"]["noticed_s"]
    )
    row(
        "  its local notification 0 at s", stopped["ours"]["notification_0_s"], stopped["mosquitto"]["notification_0_s"]
    )
    row("serving again after SIGCONT s", stopped["ours"]["serving_again_s"], stopped["mosquitto"]["serving_again_s"])
    ours, theirs = restart["ours"], restart["mosquitto"]
    row(f"restart: qos1 published ({ours['rate']:g}/s)", ours["published"], theirs["published"], ratio=False)
    row("restart: received", ours["received"], theirs["received"], ratio=False)
    row("restart: lost", ours["lost"], theirs["lost"], ratio=False)
    row("restart: all in at s", ours["all_in_s"], theirs["all_in_s"])
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    binary = mosquitto_binary()
    if binary is None:
        print("mosquitto is not installed (apt-get install mosquitto)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        figures = trio.run(measure, args, binary, Path(tmp))
    figures["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(table(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
