"""``python -m loadtest http``: keep-alive load on an HTTP server, then the same load
under a slowloris and slow-reader attack, and how long the attackers hold on.

    python -m loadtest http [--target idlekeeper|hypercorn|uvicorn] [--slowloris 500]
                            [--slow-readers 50] [--connections 50] [--duration 10]

1. **Load alone**: ``wrk`` (when installed; otherwise a small keep-alive client of
   our own) for ``--duration`` seconds: requests per second and latency.
2. **Idle memory**: ``--idle`` keep-alive connections make one request each and sit
   idle; the server's RSS added per connection. Measured before the attack, whose
   memory a server gives back seconds after it ends.
3. **Load under attack**: the same, while ``--slowloris`` attackers each send a
   request head one header line per second and never finish it, and
   ``--slow-readers`` each pipeline many requests and never read a byte (their
   receive window is tiny, so the server's writes stall).
4. **Hold time**: for each attacker, from its connect until the *server* let go of
   the connection, read from the server's own socket table (psutil), so a close
   queued behind unsendable data still counts as let go. Attackers the server never
   released are reported as held for the whole observation window.

Attackers come from their own loopback addresses (127.0.0.3 for slowloris,
127.0.0.4 for slow readers, 127.0.0.5 for the idle connections), so they are told
apart from the load on the server.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..options import add_json, add_running_server, command_parser
from ..processes import CpuSplit, free_port, load_side, pin, split_cpus, stop
from ..report import figure, number, plural, write_json, written
from ..sampler import process_tree
from .attack import Attack, idle_memory, watch_attack
from .loadgen import run_load
from .targets import ALL_HTTP_TARGETS, bench_missing, start_http_target
from .workload import HttpLoad, HttpResult, LoadFigures

__all__ = ["describe", "main", "run_http", "start_target"]


def start_target(
    target: str, load: HttpLoad, split: CpuSplit | None = None, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], int, list[int]]:
    """Start ``target`` on a free port, with ``load``'s timeouts (on the server's CPUs
    of ``split``, if given) and ``extra`` flags: its process, its port and the PIDs of
    its process tree."""
    port = free_port()
    proc = start_http_target(
        target, port, header_timeout=load.header_timeout, keep_alive=load.header_timeout, extra=extra
    )
    pids = [p.pid for p in process_tree(proc.pid)]
    if split is not None:
        pin(pids, split.server)
    return proc, port, pids


def run_http(
    target: str,
    load: HttpLoad | None = None,
    *,
    port: int | None = None,
    pids: list[int] | None = None,
    tool: str = "auto",
    window: float | None = None,
    idle: int = 2000,
    alone: LoadFigures | None = None,
    split: CpuSplit | None = None,
    beside: bool = False,
) -> HttpResult:
    """Measure ``target`` (started here unless ``port`` is given); stop what was started, by PID.

    ``alone`` is the unattacked figure measured already (then that phase is skipped).
    With ``split``, a server started here runs on its server CPUs, and the load on the
    others (a server given by ``port`` is the caller's to pin). With ``beside``, an
    unattacked load runs right before the attack and another right after it
    (:attr:`HttpResult.beside`).
    """
    load = load or HttpLoad()
    connections, duration, header_timeout = load.connections, load.duration, load.header_timeout
    slowloris, slow_readers = load.slowloris, load.slow_readers
    proc = None
    if port is None:
        proc, port, pids = start_target(target, load, split)
    result = HttpResult(target, connections, duration, slowloris, slow_readers, header_timeout)
    result.cpus = "" if split is None else repr(split)

    def phase() -> LoadFigures:
        """One load phase of the workload against the server."""
        return run_load(port, connections, duration, tool, pids or ())

    try:
        with load_side(split):
            result.alone = alone if alone is not None else phase()
            if idle and pids:
                # Before the attack: a server frees what its attackers held when its
                # collector next runs, seconds later, and that falling into the window
                # made this figure negative (for peers and ours alike).
                result.idle_connections, result.idle_rss_per_conn = idle_memory(port, pids, idle)
                time.sleep(0.5)  # their closes served before the attacked load is timed
            if beside:
                result.beside.append(phase())
            attack = Attack(port, slowloris, slow_readers)
            attack.start()
            result.attackers_connected = len(attack.connected_at)
            started = time.monotonic()
            result.window_s = window if window is not None else max(duration, 3 * header_timeout) + 5
            released: dict[tuple[str, int], float] = {}

            def watch() -> None:
                released.update(watch_attack(attack, pids or [], port, started + result.window_s))

            # Watched from the start, in a thread, so releases during the load phase are timed.
            watcher = threading.Thread(target=watch, name="attack-watch", daemon=True)
            watcher.start()
            try:
                result.attacked = phase()
                watcher.join(timeout=result.window_s + 30)
            finally:
                attack.stop()
            if beside:
                time.sleep(0.5)  # the attackers' closes served first
                result.beside.append(phase())
            for addr, kind in attack.kinds.items():
                hold = released.get(addr, result.window_s)
                if kind == "slowloris":
                    result.slowloris_hold_s.append(hold)
                    result.slowloris_still_held += addr not in released
                else:
                    result.slow_reader_hold_s.append(hold)
                    result.slow_readers_still_held += addr not in released
    finally:
        if proc is not None:
            stop(proc)
    return result


def describe(r: dict[str, Any]) -> str:
    """A short human-readable report."""
    lines = [f"target                 {r['target']}"]
    for key, label in (("alone", "load alone"), ("attacked", "under attack")):
        f = r[key]
        if f:
            lines.append(
                f"{label:<22} {figure(f['rps'], ',.0f', ' req/s')}, p50 {figure(f['p50_ms'], '.1f', ' ms')}, "
                f"p99 {figure(f['p99_ms'], '.1f', ' ms')} "
                f"({f['tool']}, {f['requests']:,} requests, {f['errors']} errors)"
            )
            user, kernel = number(f.get("user_us")), number(f.get("kernel_us"))
            if user == user:  # measured: the server's PIDs were known
                lines.append(f"{'':<22} server CPU a request: {user:.1f} µs user + {kernel:.1f} µs kernel")
    if r.get("alone_rounds"):
        rates = ", ".join(figure(f["rps"], ",.0f") for f in r["alone_rounds"])
        lines.append(f"{'rounds alone':<22} {rates} req/s (the median is the figure)")
    if r.get("beside"):
        rates = ", ".join(
            f"{figure(f['rps'], ',.0f', ' req/s')} (p99 {figure(f['p99_ms'], '.1f', ' ms')})" for f in r["beside"]
        )
        lines.append(f"{'beside the attack':<22} {rates}: unattacked, right before and after it")
    if r.get("cpus"):
        lines.append(f"{'pinned':<22} {r['cpus']}")
    # With no attacker of a kind (--slowloris 0) there is no hold to give a percentile of.
    if r["slowloris"]:
        lines.append(
            f"slowloris held         p50 {figure(r['slowloris_hold_p50_s'], '.2f', ' s')}, "
            f"max {figure(r['slowloris_hold_max_s'], '.2f', ' s')}; "
            f"{r['slowloris_still_held']} of {r['slowloris']} never released in {r['window_s']:.0f} s "
            f"(header timeout {r['header_timeout']:g} s)"
        )
    if r["slow_readers"]:
        lines.append(
            f"slow readers held      p50 {figure(r['slow_reader_hold_p50_s'], '.2f', ' s')}, "
            f"max {figure(r['slow_reader_hold_max_s'], '.2f', ' s')}; "
            f"{r['slow_readers_still_held']} of {r['slow_readers']} never released"
        )
    if r["idle_connections"]:
        lines.append(
            f"idle connections       {figure(number(r['idle_rss_per_conn']) / 1024, '.2f', ' KiB')} of server RSS each "
            f"({plural(r['idle_connections'], 'keep-alive connection')} after one request)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest http``."""
    p = command_parser("python -m loadtest http", __doc__)
    a = p.add_argument
    a(
        "--target",
        choices=ALL_HTTP_TARGETS,
        default="idlekeeper",
        help="server to start and measure (default: idlekeeper)",
    )
    add_running_server(
        p,
        port_help="measure an already running server on this port instead",
        pid_help="with --port: the server's PID (default: whichever process owns the port's sockets)",
    )
    HttpLoad.add_arguments(p)
    a(
        "--idle",
        type=int,
        default=2000,
        help="idle keep-alive connections for the memory figure; 0: skip (default 2000)",
    )
    a("--tool", choices=("auto", "wrk", "own"), default="auto", help="load client (default: wrk if installed)")
    a(
        "--pin",
        action="store_true",
        help="run the server on the last CPU and the load on the others (a server it starts; default: off)",
    )
    add_json(p, "results/http.json")
    args = p.parse_args(argv)
    why = None if args.port else bench_missing(args.target)
    if why is not None:
        print(f"{p.prog}: --target {args.target} {why}", file=sys.stderr)
        return 2
    pids = [q.pid for pid in args.pid for q in process_tree(pid)] if args.port else None
    r = run_http(
        args.target,
        HttpLoad.from_args(args),
        port=args.port,
        pids=pids,
        tool=args.tool,
        idle=args.idle,
        split=split_cpus() if args.pin and args.port is None else None,
    ).to_json()
    path = write_json(args.json, r)
    print(describe(r))
    print(written([path]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
