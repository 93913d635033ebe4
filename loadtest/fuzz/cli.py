"""``python -m loadtest fuzz``: hostile input against our servers, judged.

    python -m loadtest fuzz --target mqtt|http|both|mosquitto|ws|mqtt-ws --inputs 200000 [--seed S]
        [--engine dense|streams|both] [--connections 200] [--max-seconds 1800] [--mqtt5 0.2]

Starts the server (``servers.heartbeat`` on each engine asked for, ``servers.http``;
``--target mosquitto``: Mosquitto, as the peer, judged by the rules that apply to it)
on a free loopback port with short timeouts, keeps a well-behaved canary beside it,
and sends ``--inputs`` inputs, each on a connection of its own, ``--connections`` at a
time: valid MQTT sessions (``--mqtt5`` of them MQTT 5.0, with properties) and HTTP
requests from a seeded corpus, mutated (bit and byte flips, truncation, extension,
length and Content-Length lies, varint overflow, huge lengths, random bytes,
duplicated and reordered packets, a slow trickle of a valid prefix; and MQTT 5.0's
properties: one the packet may not carry, a single-use one twice, a property length
that lies, a string that is not UTF-8, an overlong variable byte integer) —
:mod:`.corpus`, :mod:`.corpus_v5`, :mod:`.mutators`. Every run is judged
(:mod:`.judge`): the server alive throughout and exiting 0 on SIGTERM, no
traceback in its log, a clear outcome for every connection, the canary healthy, open
files back to where they were and RSS not growing with the inputs. The report and
``results/fuzz.json`` give the counts; the exit status is 0 only if every run passed.

``--target ws`` sends WebSocket input to ``servers.http`` serving an ASGI echo app
(``loadtest.asgi_app``), ``--target mqtt-ws`` MQTT over WebSockets to the heartbeat
server's ``--ws-port``, each on the engines ``--engine`` names: opening handshakes,
then frames with one fault each (masks, lengths, fragmentation, control frames,
reserved bits and opcodes, UTF-8, compression, a text frame where MQTT goes) over a
few valid reshapings, or (``mqtt-ws``) MQTT faults in valid frames —
:mod:`.corpus_ws`, :mod:`.mutators_ws`. Each input is judged by itself too: the close
code RFC 6455 gives its fault (1002, 1007, 1009; 1003 for text on MQTT), the HTTP
status a bad handshake warrants, or what a valid input gets (its echo, its close);
the canary is an echo client, or MQTT devices over WebSockets whose presence must
stay online.

Every input is a pure function of the seed and its index (and ``--mqtt5``):
``--replay 17,4242`` (with the same ``--seed`` and ``--mqtt5``) sends just those
again, and a FAIL lists the inputs in flight when the server died or first logged a
fault, with their bytes.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import random
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from servers.workers import as_typed

from ..options import command_parser
from ..report import plural
from ..sampler import cpu_model
from .corpus import V5_SHARE
from .faults import first_fault
from .judge import Limits, Verdict, judge
from .observation import Observation
from .runner import FuzzOptions, run_target
from .targets import (
    HTTP_SERVER_ARGS,
    MQTT_SERVER_ARGS,
    WS_SERVER_ARGS,
    ServerSpec,
    http_spec,
    mosquitto_spec,
    mqtt_spec,
    mqtt_ws_spec,
    ws_spec,
)

__all__ = ["main", "machine", "render", "run"]

ENGINES = ("dense", "streams")


def machine() -> dict[str, Any]:
    """What the run ran on, for the record."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "kernel": f"{platform.system()} {platform.release()}",
    }


def _share(counter: dict[str, int], total: int, n: int = 8) -> str:
    items = collections.Counter(counter).most_common(n)
    shown = ", ".join(f"{key} {count:,}" for key, count in items)
    rest = total - sum(c for _, c in items)
    return shown + (f", other {rest:,}" if rest > 0 else "")


def render(run: dict[str, Any]) -> str:
    """A run's report, one figure per line."""
    c = run["counts"]
    done = c["inputs"]
    canary = run["canary"]
    lines = [
        f"target                 {run['target']}: seed {run['seed']}, {done:,} of {run['requested']:,} inputs "
        f"in {run['seconds']:.0f} s ({c['inputs_per_second']:,.0f}/s), {run['connections']} connections at a time",
        f"replies                {_share(c['replies'], done)}",
    ]
    if c.get("disconnects"):
        shown = _share(c["disconnects"], sum(c["disconnects"].values()))
        lines.append(f"5.0 DISCONNECTs        {shown} (by reason code)")
    if "statuses" in c:
        lines.append(f"statuses               {_share(c['statuses'], sum(c['statuses'].values()), 10)}")
    lines.append(f"endings                {_share(c['endings'], done, 10)}")
    lines.extend(_ws_lines(c))
    if "server_reasons" in c:
        reasons = c["server_reasons"]
        lines.append(f"server's log           {_share(reasons, sum(reasons.values()), 10)}")
        lines.append(
            f"                       {c['missing_ends']:,} connections without a logged end by peer "
            f"({c['missing_accepted']:,} of them accepted), {c['unattributed_ends']:,} ends logged "
            "without a known peer"
        )
    if canary["kind"] == "mqtt":
        lines.append(
            f"canary                 {plural(canary['clients'], 'client')}, {canary['exchanges']:,} pings answered "
            f"(slowest {canary['max_latency'] * 1000:,.0f} ms), {len(canary['false_offline'])} false offline, "
            f"{canary['probes']} accept probes, {len(canary['problems'])} problems"
        )
    elif canary["kind"] == "ws":
        lines.append(
            f"canary                 {canary['exchanges']:,} messages echoed "
            f"(slowest {canary['max_latency'] * 1000:,.0f} ms), {canary['probes']} WebSocket probes, "
            f"{len(canary['problems'])} problems"
        )
    else:
        lines.append(
            f"canary                 {canary['exchanges']:,} keep-alive requests 200 "
            f"(slowest {canary['max_latency'] * 1000:,.0f} ms), {canary['probes']} accept probes, "
            f"{len(canary['problems'])} problems"
        )
    fds, rss = run["fds"], run["rss"]
    lines.append(
        f"open files             {fds.get('before', '?')} before, {fds.get('canary', '?')} with the canary, "
        f"{fds.get('after_run', '?')} after the run, {fds.get('after_canary', '?')} at the end"
    )
    if rss.get("warm") and rss.get("mid") and rss.get("end"):
        lines.append(
            f"server RSS             {rss['warm'] / 2**20:.1f} MiB after the warm-up, {rss['mid'] / 2**20:.1f} "
            f"half-way, {rss['end'] / 2**20:.1f} at the end ({c['rss_growth_per_input']:+,.0f} B per input "
            f"after the warm-up, {c['rss_growth_late_per_input']:+,.0f} in the second half)"
        )
    if c.get("held_by_design"):
        lines.append(
            f"held open              {c['held_by_design']:,} connections still open after {run['wait_limit']:g} s, "
            f"closed by us: {run.get('holds', '')}"
        )
    if c.get("late_under_load"):
        lines.append(
            f"late under load        {c['late_under_load']:,} connections not closed within {run['wait_limit']:g} s "
            f"while the server was busy; sent again alone, all {c['replayed_alone']} sampled were closed in time"
        )
    exit_text = run["died"] or f"exit code {run['exit_code']} after SIGTERM"
    lines.append(
        f"server                 {c['crashes']} crashes, {c['fault_lines']:,} fault lines in its log, {exit_text}, "
        f"{c['server_cpu']:.2f} cores busy over the run"
    )
    lines.append(f"result                 {run['result']}")
    lines.extend(f"  - {reason}" for reason in run["reasons"])
    if run["suspects"]:
        lines.append(f"suspects               inputs {', '.join(str(s['index']) for s in run['suspects'][:20])}")
    return "\n".join(lines)


def _ws_lines(c: dict[str, Any]) -> list[str]:
    """The WebSocket figures: each fault's count and answers, and what was checked."""
    by_fault: dict[str, dict[str, int]] = c.get("ws_by_fault", {})
    if not by_fault:
        return []
    lines = [
        f"websocket              {c['ws_checked']:,} answers checked against their fault, "
        f"{sum(c['ws_mismatches'].values()):,} not warranted, {c['ws_bad_frames']:,} bad frames from the server, "
        f"{c['ws_reset_before_answer']:,} reset before the answer was read, {c['ws_sent_late']:,} sent after "
        f"the server's handshake deadline; echoes {_share(c['echo'], 0) or 'not checked'}"
    ]
    width = max(len(kind) for kind in by_fault)
    for kind, outcomes in by_fault.items():
        total = sum(outcomes.values())
        lines.append(f"  {kind:<{width}} {total:>7,}  {_share(outcomes, total, 4)}")
    return lines


def _record(spec: ServerSpec, options: FuzzOptions, obs: Observation, verdict: Verdict) -> dict[str, Any]:
    return {
        "target": spec.name,
        "protocol": spec.protocol,
        "seed": options.seed,
        "requested": obs.requested,
        "connections": options.connections,
        "seconds": round(obs.fuzz_seconds, 1),
        "result": "PASS" if verdict.passed else "FAIL",
        "reasons": verdict.reasons,
        "counts": verdict.counts,
        "canary": asdict(obs.canary),
        "fds": obs.fds,
        "rss": obs.rss,
        "exit_code": obs.exit_code,
        "died": obs.died,
        "server_command": shlex.join(as_typed(spec.command)),
        "wait_limit": spec.wait,
        "holds": spec.holds,
        "mqtt5_share": options.mqtt5 if spec.protocol in ("mqtt", "mqtt-ws") else 0.0,
        "suspects": obs.suspects,
        "first_fault": first_fault(obs.stderr),
    }


def run(spec: ServerSpec, options: FuzzOptions, rss_growth: float = Limits.rss_growth) -> dict[str, Any]:
    """Fuzz one server and judge it: the run's record (JSON-ready)."""
    obs = run_target(spec, options)
    verdict = judge(obs, Limits(wait=spec.wait, rss_growth=rss_growth, holds=spec.holds))
    return _record(spec, options, obs, verdict)


def specs(target: str, engine: str, server_args: Sequence[str] = ()) -> list[ServerSpec]:
    """The servers a ``--target``/``--engine`` pair asks for, in order, each with ``server_args`` added."""
    out = []
    engines = ENGINES if engine == "both" else (engine,)
    if target in ("mqtt", "both"):
        out += [mqtt_spec(e) for e in engines]
    if target in ("http", "both"):
        out.append(http_spec())
    if target == "ws":
        out += [ws_spec(e) for e in engines]
    if target == "mqtt-ws":
        out += [mqtt_ws_spec(e) for e in engines]
    for spec in out:
        spec.command += server_args
    if target == "mosquitto":
        out.append(mosquitto_spec())  # a peer: our servers' options are not its
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest fuzz``; exit 0 only if every run passed."""
    p = command_parser("python -m loadtest fuzz", __doc__)
    a = p.add_argument
    a(
        "--target",
        choices=("mqtt", "http", "both", "mosquitto", "ws", "mqtt-ws"),
        default="both",
        help="which server: ours (mqtt, http, both; ws: the HTTP server's WebSockets to an echo app; mqtt-ws: "
        "MQTT over WebSockets) or Mosquitto as the peer, with --server-args ignored (default: both)",
    )
    a("--inputs", type=int, default=200_000, help="inputs per server, one connection each (default: 200000)")
    a("--seed", type=int, default=None, help="the corpus and mutation seed (default: a random one, reported)")
    a(
        "--engine",
        choices=(*ENGINES, "both"),
        default="dense",
        help="the engine of the MQTT server, and of the servers of ws and mqtt-ws (default: dense)",
    )
    a("--connections", type=int, default=200, help="connections open at a time (default: 200)")
    a(
        "--mqtt5",
        type=float,
        default=V5_SHARE,
        help=f"share of the MQTT inputs that are MQTT 5.0 sessions, 0 to 1 (default: {V5_SHARE:g}); a server "
        "that does not serve 5.0 refuses them (3.1.1 CONNACK 1), which is a clear answer too",
    )
    a("--max-seconds", type=float, default=1800.0, help="per server: stop taking inputs after this (default: 1800)")
    a(
        "--replay",
        default=None,
        help="comma-separated input indices: send just these (with the run's --seed and --mqtt5)",
    )
    a(
        "--max-rss-growth",
        type=float,
        default=Limits.rss_growth,
        help="bytes of server RSS per input in the run's second half beyond which it fails, if it also grew "
        f"more than {Limits.rss_slack / 2**20:.0f} MiB then (default: {Limits.rss_growth:g})",
    )
    a(
        "--server-args",
        default="",
        help="more options for the server, as one string (say '--gc-freeze 0'); "
        f"MQTT runs with {' '.join(MQTT_SERVER_ARGS)}, HTTP with {' '.join(HTTP_SERVER_ARGS)}, ws with "
        f"{' '.join(WS_SERVER_ARGS[len(HTTP_SERVER_ARGS) :])} too",
    )
    a("--json", default="results/fuzz.json", help="where the results go (default: results/fuzz.json)")
    a("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.inputs < 1 or args.connections < 1 or args.max_seconds <= 0:
        p.error("--inputs, --connections and --max-seconds must be positive")
    if not 0 <= args.mqtt5 <= 1:
        p.error("--mqtt5 is a share, from 0 to 1")
    indices = None
    if args.replay:
        if args.seed is None:
            p.error("--replay needs the --seed of the run it replays")
        try:
            indices = [int(i) for i in args.replay.split(",")]
        except ValueError:
            p.error("--replay: comma-separated input indices")
    seed = args.seed if args.seed is not None else random.randrange(1, 2**31)
    options = FuzzOptions(
        inputs=args.inputs,
        seed=seed,
        connections=args.connections,
        max_seconds=args.max_seconds,
        indices=indices,
        quiet=args.quiet,
        mqtt5=args.mqtt5,
    )
    runs = []
    try:
        chosen = specs(args.target, args.engine, shlex.split(args.server_args))
    except RuntimeError as exc:  # mosquitto is not installed
        p.error(str(exc))
    for spec in chosen:
        if not args.quiet:
            print(f"fuzzing {spec.name} (seed {seed})...", file=sys.stderr, flush=True)
        try:
            record = run(spec, options, args.max_rss_growth)
        except RuntimeError as exc:  # the server or the canary did not start
            record = {"target": spec.name, "seed": seed, "result": "FAIL", "reasons": [f"could not run: {exc}"]}
            print(f"target                 {spec.name}: could not run: {exc}\n", flush=True)
        else:
            print(render(record) + "\n", flush=True)
        runs.append(record)
    passed = all(r["result"] == "PASS" for r in runs)
    out = {
        "command": "python -m loadtest fuzz " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "result": "PASS" if passed else "FAIL",
        "runs": runs,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"result                 {out['result']} ({len(runs)} runs)")
    print(f"written                {path}")
    return 0 if passed else 1
