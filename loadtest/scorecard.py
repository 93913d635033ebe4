"""``python -m loadtest scorecard``: the speed and memory targets against the peers users pick, judged in one command.

    python -m loadtest scorecard [--rounds 2] [--only mqtt,qos,http,tls] [--devices 10000]
                                 [--out results/scorecard.json] [--render JSON]

The targets (issue 30) compare our servers with what a user would run instead:
Mosquitto for MQTT, uvicorn[standard] (httptools and uvloop) and granian for HTTP.
Each is a ratio taken inside one run, since these shared machines drift by tens of
percent between runs. A round runs four parts, one after the other, with the
workloads the targets were set on:

- ``mqtt``: :func:`loadtest.compare.compare_devices`, ``--devices`` MQTT 3.1.1
  devices (keep-alive 5 s, 5 % going silent, pings spread out) against ours at the
  default, ours with ``--coalesce-pings 0.1`` and Mosquitto: RSS per idle device, and
  CPU per 1,000 heartbeats a second with close lateness p99 within one tick;
- ``qos``: :func:`loadtest.qos.run_qos`, QoS 1 forwarding (exactly once, in order)
  and the drain of a stored queue of 200,000 messages, ours against Mosquitto;
- ``http``: :func:`loadtest.compare.compare_http`, req/s of the same ASGI app against
  uvicorn[standard] and granian (each pinned to a core, the median of three
  interleaved rounds), then ours under slowloris and slow-reader attack, judged
  against two unattacked loads run right before and after it;
- ``tls``: :func:`loadtest.tls_load.run_target`, server CPU per full TLS handshake,
  ours against Mosquitto.

``--rounds`` repeats the whole set; the table gives every round's ratio, their median
and in how many rounds each target was met, since a ratio near its line lands on
either side of it from one run to the next here. A peer that is not installed makes
its targets "not measured", never met. ``--render`` prints the table of an earlier
run's JSON. Each run also updates the scoreboard (``--board``, ``docs/performance.md``
and its record beside it, :mod:`loadtest.scoreboard`) for the targets it measured.
Loopback only; every server is stopped by its PID.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import scoreboard
from .compare import compare_devices, compare_http
from .http.workload import HttpLoad
from .options import add_devices, add_json, add_quiet, command_parser
from .qos import run_qos
from .qos.load import QosLoad
from .report import number, show_table, write_json
from .tls_load import TlsLoad, run_targets
from .workload import DeviceLoad

__all__ = ["GOALS", "PARTS", "Goal", "Reading", "Workloads", "judge", "main", "render", "run_round"]

PARTS = ("mqtt", "qos", "http", "tls")
TICK = 0.1
"""Our MQTT server's tick in the device part, which close lateness p99 must stay within."""
PINGS_WINDOW = 0.1
"""``--coalesce-pings`` of the ``idlekeeper-pings`` row."""


@dataclass(frozen=True)
class Goal:
    """One target: a ratio and the side of ``limit`` it must land on."""

    key: str
    what: str
    limit: float
    at_least: bool
    """True: the ratio must be at least ``limit``; False: at most."""

    @property
    def line(self) -> str:
        """The target as written: ``≥ 1.0×``."""
        return f"{'≥' if self.at_least else '≤'} {self.limit:.1f}×"

    def met(self, ratio: float) -> bool:
        """Whether ``ratio`` meets it (a missing ratio never does)."""
        if ratio != ratio:
            return False
        return ratio >= self.limit if self.at_least else ratio <= self.limit


GOALS = (
    Goal("http_uvicorn", "HTTP req/s, against uvicorn[standard]", 1.0, True),
    Goal("http_granian", "HTTP req/s, against granian", 1.0, True),
    Goal("http_attack_p99", "HTTP p99 under attack, against ours unattacked", 2.0, False),
    Goal("http_attack_kept", "HTTP req/s kept under attack, against ours unattacked", 0.9, True),
    Goal("mqtt_memory", "MQTT RSS per idle device, against Mosquitto", 1.0, False),
    Goal("mqtt_cpu", "MQTT CPU per 1k heartbeats/s, default, against Mosquitto", 1.0, False),
    Goal("mqtt_cpu_pings", f"the same with --coalesce-pings {PINGS_WINDOW:g}", 1.0, False),
    Goal("qos_forwarding", "QoS 1 forwarding msg/s, against Mosquitto", 1.0, True),
    Goal("qos_drain", "stored-queue drain msg/s, against Mosquitto", 0.5, True),
    Goal("tls_handshake", "CPU per TLS handshake, against Mosquitto", 1.5, False),
)


@dataclass(frozen=True)
class Reading:
    """A goal's outcome in one round: the ratio (NaN if not measured), whether it was
    met, and why not when a condition beside the ratio failed or a side is missing."""

    ratio: float
    met: bool
    why: str = ""


def _divide(ours: float, theirs: float) -> float:
    return ours / theirs if ours == ours and theirs == theirs and theirs else float("nan")


def _reading(goal: Goal, ratio: float, broken: str = "") -> Reading:
    """``broken``: a condition the target sets beside its ratio that failed."""
    if ratio != ratio:
        return Reading(ratio, False, broken or "not measured")
    return Reading(ratio, goal.met(ratio) and not broken, broken)


def _absent(rows: dict[str, Any], missing: dict[str, str], *names: str) -> str:
    gone = [f"{n}: {missing.get(n, 'did not run')}" for n in names if n not in rows]
    return "; ".join(gone)


def _mqtt(part: dict[str, Any]) -> dict[str, Reading]:
    rows, runs, missing = part["rows"], part["runs"], part["missing"]
    out: dict[str, Reading] = {}
    gone = _absent(rows, missing, "idlekeeper", "mosquitto")
    mosq = rows.get("mosquitto", {})
    ours = rows.get("idlekeeper", {})
    out["mqtt_memory"] = (
        Reading(float("nan"), False, gone)
        if gone
        else _reading(GOALS_BY_KEY["mqtt_memory"], _divide(ours["rss_per_conn_bytes"], mosq["rss_per_conn_bytes"]))
    )
    for key, name in (("mqtt_cpu", "idlekeeper"), ("mqtt_cpu_pings", "idlekeeper-pings")):
        gone = _absent(rows, missing, name, "mosquitto")
        if gone:
            out[key] = Reading(float("nan"), False, gone)
            continue
        row = rows[name]
        tick_ms = 1000 * number(runs[name].get("tick_s", TICK))
        broken = []
        if not row["lateness_p99_ms"] <= tick_ms:
            broken.append(f"close lateness p99 {row['lateness_p99_ms']:.0f} ms, past the {tick_ms:.0f} ms tick")
        if row["false_expiries"]:
            broken.append(f"{row['false_expiries']:.0f} false expiries")
        out[key] = _reading(
            GOALS_BY_KEY[key], _divide(row["cpu_pct_per_1k_hbps"], mosq["cpu_pct_per_1k_hbps"]), "; ".join(broken)
        )
    return out


def _qos(part: dict[str, Any]) -> dict[str, Reading]:
    rows, missing = part["rows"], part["missing"]
    gone = _absent(rows, missing, "idlekeeper", "mosquitto")
    if gone:
        return {key: Reading(float("nan"), False, gone) for key in ("qos_forwarding", "qos_drain")}
    ours, mosq = rows["idlekeeper"], rows["mosquitto"]
    faults = [f"{ours[k]:.0f} {label}" for k, label in _FORWARD_FAULTS if ours[k]]
    drain_faults = [f"{ours[k]:.0f} {label}" for k, label in _DRAIN_FAULTS if ours[k]]
    forwarding = _reading(
        GOALS_BY_KEY["qos_forwarding"], _divide(ours["msgs_per_s"], mosq["msgs_per_s"]), "; ".join(faults)
    )
    # The peer is held to nothing, but a rate bought by losing or reordering messages
    # is said beside the ratio.
    theirs = [f"{mosq[k]:.0f} {label}" for k, label in _FORWARD_FAULTS if mosq[k]]
    if theirs:
        said = "; ".join(filter(None, [forwarding.why, "Mosquitto " + ", ".join(theirs)]))
        forwarding = Reading(forwarding.ratio, forwarding.met, said)
    return {
        "qos_forwarding": forwarding,
        "qos_drain": _reading(
            GOALS_BY_KEY["qos_drain"],
            _divide(ours["drain_msgs_per_s"], mosq["drain_msgs_per_s"]),
            "; ".join(drain_faults),
        ),
    }


# Forwarding counts only exactly once and in order (a NaN count, not measured, is truthy too).
_FORWARD_FAULTS = (("lost", "lost"), ("duplicates", "duplicated"), ("out_of_order", "out of order"))
_DRAIN_FAULTS = (("queued_lost", "lost from the queue"), ("queued_out_of_order", "drained out of order"))


def _http(part: dict[str, Any]) -> dict[str, Reading]:
    rows, runs, missing = part["rows"], part["runs"], part["missing"]
    out: dict[str, Reading] = {}
    for key, peer in (("http_uvicorn", "uvicorn-standard"), ("http_granian", "granian")):
        gone = _absent(rows, missing, "idlekeeper", peer)
        out[key] = (
            Reading(float("nan"), False, gone)
            if gone
            else _reading(GOALS_BY_KEY[key], _divide(rows["idlekeeper"]["rps"], rows[peer]["rps"]))
        )
    gone = _absent(rows, missing, "idlekeeper")
    if gone:
        out["http_attack_p99"] = out["http_attack_kept"] = Reading(float("nan"), False, gone)
        return out
    ours = runs["idlekeeper"]
    attacked = ours.get("attacked") or {}
    # Against the unattacked loads run right before and after the attack, when there
    # were any: the interleaved rounds' median is minutes older, and on a shared
    # machine the minute's drift is as large as the attack's cost.
    alone = ours.get("alone") or {}
    rps, p99 = number(ours.get("rps_beside")), number(ours.get("p99_ms_beside"))
    if rps != rps or p99 != p99:
        rps, p99 = number(alone.get("rps")), number(alone.get("p99_ms"))
    errors = number(attacked.get("errors"))
    broken = f"{errors:.0f} errors under attack" if errors else ""
    out["http_attack_p99"] = _reading(
        GOALS_BY_KEY["http_attack_p99"], _divide(number(attacked.get("p99_ms")), p99), broken
    )
    out["http_attack_kept"] = _reading(
        GOALS_BY_KEY["http_attack_kept"], _divide(number(attacked.get("rps")), rps), broken
    )
    return out


def _tls(part: dict[str, Any]) -> dict[str, Reading]:
    runs, missing = part["runs"], part["missing"]
    gone = _absent(runs, missing, "idlekeeper", "mosquitto")
    if gone:
        return {"tls_handshake": Reading(float("nan"), False, gone)}
    ours, mosq = runs["idlekeeper"], runs["mosquitto"]
    return {
        "tls_handshake": _reading(
            GOALS_BY_KEY["tls_handshake"],
            _divide(number(ours.get("handshake_cpu_ms")), number(mosq.get("handshake_cpu_ms"))),
        )
    }


GOALS_BY_KEY = {g.key: g for g in GOALS}
_JUDGES: dict[str, Callable[[dict[str, Any]], dict[str, Reading]]] = {
    "mqtt": _mqtt,
    "qos": _qos,
    "http": _http,
    "tls": _tls,
}


def judge(round_: dict[str, Any]) -> dict[str, Reading]:
    """Each goal's reading in one round: ``round_`` maps a part (``mqtt``, ``qos``,
    ``http``, ``tls``) to what its run returned; a part not run has no readings."""
    out: dict[str, Reading] = {}
    for part, result in round_.items():
        out.update(_JUDGES[part](result))
    return out


def render(rounds: Sequence[dict[str, Any]]) -> str:
    """The scorecard (Markdown): a row per goal measured, each round's ratio, their
    median, and how many rounds met it."""
    judged = [judge(r) for r in rounds]
    heads = [f"round {i + 1}" for i in range(len(judged))]
    lines = [
        "| target | goal | " + " | ".join(heads) + " | median | met |",
        "|---|---|" + "---:|" * len(heads) + "---:|---|",
    ]
    notes: list[str] = []
    for goal in GOALS:
        readings = [j.get(goal.key) for j in judged]
        if all(r is None for r in readings):
            continue
        cells = []
        for i, r in enumerate(readings):
            if r is None:
                cells.append("")
                continue
            mark = "" if r.met else " ✗"
            cells.append(("—" if r.ratio != r.ratio else f"{r.ratio:.2f}×") + mark)
            if r.why:
                notes.append(f"- {goal.what}, round {i + 1}: {r.why}")
        measured = [r.ratio for r in readings if r is not None and r.ratio == r.ratio]
        median = f"{statistics.median(measured):.2f}×" if measured else "—"
        met = sum(1 for r in readings if r is not None and r.met)
        taken = sum(1 for r in readings if r is not None)
        status = "met" if met == taken else "not met" if not met else f"met in {met} of {taken}"
        lines.append(f"| {goal.what} | {goal.line} | " + " | ".join(cells) + f" | {median} | {status} |")
    return "\n".join(lines + (["", *notes] if notes else []))


@dataclass(frozen=True)
class Workloads:
    """What each part runs: the targets' workloads by default (smaller ones in tests)."""

    # Pings spread out (no batching), a 30 s steady window, no stall: the device
    # workload the MQTT targets were set on.
    devices: DeviceLoad = field(
        default_factory=lambda: DeviceLoad(devices=10_000, keepalive=5, stall=False, ping_batch=0.0, steady=30.0)
    )
    # 200,000 messages: a drain of the default 50,000 is over in a quarter of a second
    # for Mosquitto, short enough that one hiccup of the machine moved the ratio by half.
    qos: QosLoad = field(default_factory=lambda: QosLoad(queued=200_000))
    http: HttpLoad = field(default_factory=HttpLoad)
    http_rounds: int = 3
    tls: TlsLoad = field(default_factory=TlsLoad)


def _kept(part: dict[str, Any]) -> dict[str, Any]:
    # What the judging reads of a part's result (its table and load are left out).
    return {k: part[k] for k in ("runs", "rows", "missing")}


def run_round(parts: Sequence[str], loads: Workloads, quiet: bool = False) -> dict[str, Any]:
    """One round of ``parts``: each part's runs, rows and missing targets, as its own
    command has them."""
    out: dict[str, Any] = {}
    if "mqtt" in parts:
        part = compare_devices(
            loads.devices, ["idlekeeper", "idlekeeper-pings", "mosquitto"], TICK, quiet, coalesce_pings=PINGS_WINDOW
        )
        out["mqtt"] = _kept(part)
    if "qos" in parts:
        part = run_qos(loads.qos, ["idlekeeper", "mosquitto"], quiet=quiet)
        out["qos"] = _kept(part)
    if "http" in parts:
        targets = ["idlekeeper", "uvicorn-standard", "granian"]
        part = compare_http(loads.http, targets, rounds=loads.http_rounds, pinned=True)
        out["http"] = _kept(part)
    if "tls" in parts:
        say: Callable[[str], None] = (lambda line: None) if quiet else print
        results, missing = run_targets(["idlekeeper", "mosquitto"], loads.tls, say)
        out["tls"] = {"runs": {name: asdict(r) for name, r in results.items()}, "missing": missing}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest scorecard``."""
    p = command_parser("python -m loadtest scorecard", __doc__)
    a = p.add_argument
    a("--rounds", type=int, default=1, help="times the whole set runs (default: 1)")
    a("--only", default=",".join(PARTS), help=f"comma-separated parts, of {', '.join(PARTS)} (default: all)")
    add_devices(p, 10_000, help="MQTT devices per target in the mqtt part (default: 10,000)")
    add_json(p, "results/scorecard.json", table=True, flag="--out")
    add_quiet(p)
    a("--render", default=None, metavar="JSON", help="only print the scorecard of an earlier run's JSON")
    a(
        "--board",
        default=str(scoreboard.BOARD),
        metavar="PAGE",
        help="the scoreboard page this run updates, its record beside it as .json ('' for none;"
        " default: docs/performance.md)",
    )
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())["rounds"]))
        return 0
    parts = [x for x in args.only.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--only: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    loads = Workloads(devices=dataclasses.replace(Workloads().devices, devices=args.devices))
    rounds = []
    for i in range(args.rounds):
        print(f"\n==== scorecard: round {i + 1} of {args.rounds} ====", flush=True)
        rounds.append(run_round(parts, loads, args.quiet))
        # Written after every round: a long run stopped early keeps what it measured.
        path = write_json(args.out, {"parts": parts, "rounds": rounds})
    text = render(rounds)
    show_table(path, text)
    if args.board:
        shown = scoreboard.measured_by(sys.argv[1:] if argv is None else argv)
        scoreboard.update(Path(args.board), GOALS, [judge(r) for r in rounds], command=shown)
        print(f"scoreboard             {args.board}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
