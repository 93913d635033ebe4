"""``python -m loadtest http``: keep-alive load on an HTTP server, then the same load
under a slowloris and slow-reader attack, and how long the attackers hold on.

    python -m loadtest http [--target idlekeeper|hypercorn|uvicorn] [--slowloris 500]
                            [--slow-readers 50] [--connections 50] [--duration 10]

1. **Load alone**: ``wrk`` (when installed; otherwise a small keep-alive client of
   our own) for ``--duration`` seconds: requests per second and latency.
2. **Load under attack**: the same, while ``--slowloris`` attackers each send a
   request head one header line per second and never finish it, and
   ``--slow-readers`` each pipeline many requests and never read a byte (their
   receive window is tiny, so the server's writes stall).
3. **Hold time**: for each attacker, from its connect until the *server* let go of
   the connection, read from the server's own socket table (psutil), so a close
   queued behind unsendable data still counts as let go. Attackers the server never
   released are reported as held for the whole observation window.
4. **Idle memory**: ``--idle`` keep-alive connections make one request each and sit
   idle; the server's RSS added per connection.

Attackers come from their own loopback addresses (127.0.0.3 for slowloris,
127.0.0.4 for slow readers, 127.0.0.5 for the idle connections), so they are told
apart from the load on the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .http_targets import ALL_HTTP_TARGETS, start_http_target
from .processes import CpuSplit, free_port, load_side, pin, split_cpus, stop
from .sampler import Sampler, process_tree
from .stats import percentile

__all__ = ["HttpLoad", "HttpResult", "LoadFigures", "main", "median_round", "run_http", "start_target"]

SLOWLORIS_SOURCE = "127.0.0.3"
SLOW_READER_SOURCE = "127.0.0.4"
IDLE_SOURCE = "127.0.0.5"
_REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@dataclass(frozen=True)
class HttpLoad:
    """The HTTP workload: keep-alive load alone, then beside attackers. ``loadtest http``
    and ``loadtest compare`` both take their defaults and flags from here."""

    connections: int = 50
    """Keep-alive connections of legitimate load."""
    duration: float = 10.0
    """Seconds of each load phase."""
    slowloris: int = 500
    """Attackers that trickle a header line a second and never end the head."""
    slow_readers: int = 50
    """Attackers that pipeline requests and never read the replies."""
    header_timeout: float = 5.0
    """The servers' header (and keep-alive) timeout, in seconds."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """Add the workload's flags; ``prefix`` goes before ``connections`` and ``duration``."""
        d = HttpLoad()
        a = parser.add_argument
        a(
            f"--{prefix}connections",
            type=int,
            default=d.connections,
            help=f"keep-alive load connections (default: {d.connections})",
        )
        a(
            f"--{prefix}duration",
            type=float,
            default=d.duration,
            help=f"seconds of each load phase (default: {d.duration:g})",
        )
        a("--slowloris", type=int, default=d.slowloris, help=f"slowloris attackers (default: {d.slowloris})")
        a("--slow-readers", type=int, default=d.slow_readers, help=f"slow readers (default: {d.slow_readers})")
        a(
            "--header-timeout",
            type=float,
            default=d.header_timeout,
            help=f"the servers' header (and keep-alive) timeout (default: {d.header_timeout:g})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> HttpLoad:
        """The workload from flags added by :meth:`add_arguments` with the same ``prefix``."""
        p = prefix.replace("-", "_")
        return cls(
            connections=getattr(args, f"{p}connections"),
            duration=getattr(args, f"{p}duration"),
            slowloris=args.slowloris,
            slow_readers=args.slow_readers,
            header_timeout=args.header_timeout,
        )


@dataclass
class LoadFigures:
    """Legitimate load: throughput and latency."""

    tool: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


@dataclass
class HttpResult:
    """One target's figures."""

    target: str
    connections: int
    duration: float
    slowloris: int
    slow_readers: int
    header_timeout: float
    alone: LoadFigures | None = None
    attacked: LoadFigures | None = None
    slowloris_hold_s: list[float] = field(default_factory=list)
    slow_reader_hold_s: list[float] = field(default_factory=list)
    slowloris_still_held: int = 0
    slow_readers_still_held: int = 0
    attackers_connected: int = 0
    window_s: float = 0.0
    idle_connections: int = 0
    idle_rss_per_conn: float = math.nan
    """Server RSS added per idle keep-alive connection (bytes), after one request each."""
    alone_rounds: list[LoadFigures] = field(default_factory=list)
    """Every unattacked round, when ``alone`` is their median (``compare --rounds``)."""
    cpus: str = ""
    """Where the server and the load ran, when pinned apart."""

    def to_json(self) -> dict[str, Any]:
        """Flat figures for the comparison table, plus everything measured."""
        out = asdict(self)

        out.update(
            rps=self.alone.rps if self.alone else math.nan,
            p99_ms=self.alone.p99_ms if self.alone else math.nan,
            rps_attack=self.attacked.rps if self.attacked else math.nan,
            p99_ms_attack=self.attacked.p99_ms if self.attacked else math.nan,
            slowloris_hold_p50_s=percentile(self.slowloris_hold_s, 50),
            slowloris_hold_max_s=max(self.slowloris_hold_s, default=math.nan),
            slow_reader_hold_p50_s=percentile(self.slow_reader_hold_s, 50),
            slow_reader_hold_max_s=max(self.slow_reader_hold_s, default=math.nan),
        )
        return out


# -- legitimate load ----------------------------------------------------------------


def _ms(text: str) -> float:
    match = re.match(r"([\d.]+)(us|ms|s)", text)
    if not match:
        return math.nan
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(port: int, connections: int, duration: float) -> LoadFigures:
    """``wrk -t1 --latency``: one thread is plenty for a single-process Python server."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", f"http://127.0.0.1:{port}/"],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    ).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    errors += int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    return LoadFigures(
        "wrk",
        int(total.group(1)) if total else 0,
        float(rps.group(1)) if rps else math.nan,
        _ms(p50.group(1)) if p50 else math.nan,
        _ms(p99.group(1)) if p99 else math.nan,
        errors,
    )


def run_own_client(port: int, connections: int, duration: float) -> LoadFigures:
    """Keep-alive GETs on ``connections`` sockets, one request in flight on each."""
    sel = selectors.DefaultSelector()
    latencies: list[float] = []
    errors = 0
    sent_at: dict[socket.socket, float] = {}
    buffers: dict[socket.socket, bytes] = {}
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        sock.send(_REQUEST)
        sent_at[sock] = time.perf_counter()
        buffers[sock] = b""
    end = time.monotonic() + duration
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=0.5):
            sock = key.fileobj  # type: ignore[assignment]
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                errors += 1
                sel.unregister(sock)
                sock.close()
                continue
            buf = buffers[sock] + data
            head, sep, body = buf.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if not sep or not length or len(body) < int(length.group(1)):
                buffers[sock] = buf
                continue
            buffers[sock] = body[int(length.group(1)) :]
            latencies.append(time.perf_counter() - sent_at[sock])
            sock.send(_REQUEST)
            sent_at[sock] = time.perf_counter()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    ms = [v * 1000 for v in latencies]
    return LoadFigures("own client", len(ms), len(ms) / duration, percentile(ms, 50), percentile(ms, 99), errors)


def median_round(rounds: Sequence[LoadFigures]) -> LoadFigures:
    """The round with the median throughput (the lower of the two middle ones for an
    even count), with its own latencies: a figure measured, not a blend."""
    if not rounds:
        raise ValueError("no rounds")
    ordered = sorted(rounds, key=lambda r: (r.rps != r.rps, r.rps))
    return ordered[(len(ordered) - 1) // 2]


def run_load(port: int, connections: int, duration: float, tool: str = "auto") -> LoadFigures:
    """wrk when installed (or asked for), else the own client."""
    if tool == "wrk" or (tool == "auto" and shutil.which("wrk")):
        return run_wrk(port, connections, duration)
    return run_own_client(port, connections, duration)


# -- attackers ------------------------------------------------------------------------


class Attack:
    """Slowloris attackers and slow readers, driven by one thread until stopped."""

    def __init__(self, port: int, slowloris: int, slow_readers: int, pipelined: int = 2000) -> None:
        self.port = port
        self.connected_at: dict[tuple[str, int], float] = {}
        self.kinds: dict[tuple[str, int], str] = {}
        self._loris: list[socket.socket] = []
        self._readers: list[socket.socket] = []
        self._stop = threading.Event()
        self._plan = (slowloris, slow_readers, pipelined)
        self._thread = threading.Thread(target=self._run, name="attack", daemon=True)

    def _open(self, source: str, rcvbuf: int | None = None) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            # Before connect(), so the window the server sees is tiny from the start.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            sock.bind((source, 0))
            sock.settimeout(5)
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        addr = sock.getsockname()
        self.connected_at[(addr[0], addr[1])] = time.monotonic()
        self.kinds[(addr[0], addr[1])] = "slowloris" if source == SLOWLORIS_SOURCE else "slow reader"
        sock.setblocking(False)
        return sock

    def start(self) -> None:
        """Connect every attacker (in this thread), then trickle from a background thread."""
        slowloris, slow_readers, pipelined = self._plan
        for _ in range(slowloris):
            sock = self._open(SLOWLORIS_SOURCE)
            if sock is not None:
                self._loris.append(sock)
                with contextlib.suppress(OSError):
                    sock.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        burst = _REQUEST * pipelined
        for _ in range(slow_readers):
            sock = self._open(SLOW_READER_SOURCE, rcvbuf=4096)
            if sock is not None:
                self._readers.append(sock)
                with contextlib.suppress(OSError):
                    sock.send(burst)  # as much as fits; the rest is never sent
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(1.0) and n < 10_000:
            n += 1
            for sock in self._loris:
                with contextlib.suppress(OSError):
                    sock.send(b"X-Trickle-%d: %d\r\n" % (n, n))  # one more header line, never the blank one

    def stop(self) -> None:
        """Stop trickling and close every attacker socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sock in self._loris + self._readers:
            sock.close()


def idle_memory(port: int, pids: list[int], n: int, source: str = IDLE_SOURCE) -> tuple[int, float]:
    """Open ``n`` keep-alive connections that each make one request, then sit idle;
    return how many did, and the server's RSS added per connection."""
    sampler = Sampler(lambda: pids)
    before = sampler.take().rss
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.settimeout(5)
            try:
                sock.bind((source, 0))
                sock.connect(("127.0.0.1", port))
                sock.sendall(_REQUEST)
                sock.recv(65536)  # the small response; the connection stays open
            except OSError:
                socks.pop().close()
        time.sleep(0.5)  # every handler back to waiting for its next request
        after = sampler.take().rss
    finally:
        for sock in socks:
            sock.close()
    return len(socks), (after - before) / len(socks) if socks else math.nan


def held_by_server(pids: list[int], port: int) -> set[tuple[str, int]]:
    """The remote addresses of the connections the server's processes still have open on ``port``.

    Without ``pids`` (``--port`` with no ``--pid``), any process's sockets on ``port``
    count. Sockets no process owns (closed by the server, FIN queued behind unsent
    data) have no PID and count as released either way.
    """
    held: set[tuple[str, int]] = set()
    conns: list[Any] = []
    if not pids:
        with contextlib.suppress(psutil.Error):
            conns = [c for c in psutil.net_connections(kind="tcp") if c.pid is not None]
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            conns += psutil.Process(pid).net_connections(kind="tcp")
    for c in conns:
        if c.laddr and c.laddr[1] == port and c.raddr:
            held.add((c.raddr[0], c.raddr[1]))
    return held


def waiting_in_kernel(port: int) -> set[tuple[str, int]]:
    """Remote addresses of the ESTABLISHED IPv4 connections to local ``port``, owned or not.

    Read from ``/proc/net/tcp``: a connection the server has closed is no longer
    ESTABLISHED (FIN-WAIT or gone), while one still in the accept queue is.
    """
    found: set[tuple[str, int]] = set()
    with contextlib.suppress(OSError), open("/proc/net/tcp") as table:
        next(table, None)
        for line in table:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state != "01" or int(local.rsplit(":", 1)[1], 16) != port:
                continue
            host, rport = remote.split(":")
            quad = bytes.fromhex(host)[::-1]  # little-endian in the table
            found.add((".".join(str(b) for b in quad), int(rport, 16)))
    return found


def watch_attack(attack: Attack, pids: list[int], port: int, until: float) -> dict[tuple[str, int], float]:
    """Poll the socket tables until every attacker is released or ``until``; their hold times.

    Released means no longer in the server's processes and no longer ESTABLISHED in
    the kernel: a connection still in the accept queue is the server's to answer, so
    it counts as held, while one the server closed between two polls (before this
    watcher ever saw it owned) counts as released.
    """
    released: dict[tuple[str, int], float] = {}
    pending = set(attack.connected_at)
    while pending and time.monotonic() < until:
        held = held_by_server(pids, port) | waiting_in_kernel(port)
        now = time.monotonic()
        for addr in list(pending):
            if addr not in held:
                released[addr] = now - attack.connected_at[addr]
                pending.discard(addr)
        time.sleep(0.2)
    return released


def start_target(
    target: str, load: HttpLoad, split: CpuSplit | None = None
) -> tuple[subprocess.Popen[str], int, list[int]]:
    """Start ``target`` on a free port, with ``load``'s timeouts (on the server's CPUs
    of ``split``, if given): its process, its port and the PIDs of its process tree."""
    port = free_port()
    proc = start_http_target(target, port, header_timeout=load.header_timeout, keep_alive=load.header_timeout)
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
) -> HttpResult:
    """Measure ``target`` (started here unless ``port`` is given); stop what was started, by PID.

    ``alone`` is the unattacked figure measured already (then that phase is skipped).
    With ``split``, a server started here runs on its server CPUs, and the load on the
    others (a server given by ``port`` is the caller's to pin).
    """
    load = load or HttpLoad()
    connections, duration, header_timeout = load.connections, load.duration, load.header_timeout
    slowloris, slow_readers = load.slowloris, load.slow_readers
    proc = None
    if port is None:
        proc, port, pids = start_target(target, load, split)
    result = HttpResult(target, connections, duration, slowloris, slow_readers, header_timeout)
    result.cpus = "" if split is None else repr(split)
    try:
        with load_side(split):
            result.alone = alone if alone is not None else run_load(port, connections, duration, tool)
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
                result.attacked = run_load(port, connections, duration, tool)
                watcher.join(timeout=result.window_s + 30)
            finally:
                attack.stop()
            for addr, kind in attack.kinds.items():
                hold = released.get(addr, result.window_s)
                if kind == "slowloris":
                    result.slowloris_hold_s.append(hold)
                    result.slowloris_still_held += addr not in released
                else:
                    result.slow_reader_hold_s.append(hold)
                    result.slow_readers_still_held += addr not in released
            if idle and pids:
                result.idle_connections, result.idle_rss_per_conn = idle_memory(port, pids, idle)
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
                f"{label:<22} {f['rps']:,.0f} req/s, p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms "
                f"({f['tool']}, {f['requests']:,} requests, {f['errors']} errors)"
            )
    if r.get("alone_rounds"):
        rates = ", ".join(f"{f['rps']:,.0f}" for f in r["alone_rounds"])
        lines.append(f"{'rounds alone':<22} {rates} req/s (the median is the figure)")
    if r.get("cpus"):
        lines.append(f"{'pinned':<22} {r['cpus']}")
    lines.append(
        f"slowloris held         p50 {r['slowloris_hold_p50_s']:.2f} s, max {r['slowloris_hold_max_s']:.2f} s; "
        f"{r['slowloris_still_held']} of {r['slowloris']} never released in {r['window_s']:.0f} s "
        f"(header timeout {r['header_timeout']:g} s)"
    )
    lines.append(
        f"slow readers held      p50 {r['slow_reader_hold_p50_s']:.2f} s, max {r['slow_reader_hold_max_s']:.2f} s; "
        f"{r['slow_readers_still_held']} of {r['slow_readers']} never released"
    )
    if r["idle_connections"]:
        lines.append(
            f"idle connections       {r['idle_rss_per_conn'] / 1024:.2f} KiB of server RSS each "
            f"({r['idle_connections']:,} keep-alive connections after one request)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest http``."""
    p = argparse.ArgumentParser(
        prog="python -m loadtest http", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    a = p.add_argument
    a(
        "--target",
        choices=ALL_HTTP_TARGETS,
        default="idlekeeper",
        help="server to start and measure (default: idlekeeper)",
    )
    a("--port", type=int, default=None, help="measure an already running server on this port instead")
    a(
        "--pid",
        type=int,
        action="append",
        default=[],
        help="with --port: the server's PID (default: whichever process owns the port's sockets)",
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
    a("--json", default="results/http.json", help="JSON results (default: results/http.json)")
    args = p.parse_args(argv)
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
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1, default=float))
    print(describe(r))
    print(f"written                {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
