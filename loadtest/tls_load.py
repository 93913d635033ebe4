"""``python -m loadtest tls``: MQTT over TLS, ours beside Mosquitto, in one run.

    python -m loadtest tls [--connections 2000] [--seconds 10] [--concurrency 4] [--targets idlekeeper,mosquitto]

For each target, on loopback, with a fresh CA and server certificate (ECDSA P-256,
made by trustme in a temporary directory) and a fresh server process:

**Memory per idle TLS connection**: the server's RSS (psutil, every process) before
and after N clients each complete a TLS handshake, CONNECT (keep-alive 0: no pings)
and read their CONNACK, then hold still; the delta over N. The clients run in this
process, ``--concurrency`` x 8 handshakes at a time.

**Full handshakes per second**: ``--concurrency`` ``openssl s_time -new`` processes
(a C client, one connection at a time each, a new session each time: no resumption)
against the port for ``--seconds``, and the server's CPU per handshake over that
window: on two cores the clients take CPU too, so the rate is the machine's, and the
CPU per handshake is the server's own cost.

**MQTT connects per second over TLS**: ``--concurrency`` clients in this process,
each in a loop for ``--seconds``: TCP connect, full TLS handshake, CONNECT,
CONNACK, DISCONNECT, close. Its CPU is reported beside the rate: a client near
100% of a core is the bottleneck, and the rate is then a lower bound.

Targets: ``idlekeeper`` is ``servers.heartbeat --workers 1`` with ``--tls-cert`` on its
default dense engine (TLS from the engine's callbacks, no task per connection);
``idlekeeper-streams`` the same with ``--engine streams`` (trio's SSLStream, a task
per connection); ``mosquitto`` is the Debian broker with a listener
carrying ``certfile``/``keyfile``, as an 8883 listener would, and ``set_tcp_nodelay
true`` (trio sets TCP_NODELAY on every socket; without it Mosquitto's CONNACK waits
~40 ms on Nagle and a delayed ACK). Ratios are each of ours over
Mosquitto's. Every phase is bounded in count and time, and every process is
stopped by its PID.
"""

from __future__ import annotations

import math
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import trio
import trustme

from servers.heartbeat.mqtt import encoders

from .mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from .options import add_json, add_quiet, add_targets, command_parser, fields_from
from .processes import free_port, start_heartbeat
from .report import figure, plural, ratio, write_json, write_table
from .sampler import cpu_seconds, processes, rss_bytes

__all__ = ["CertFiles", "TlsLoad", "TlsResult", "main", "make_certs", "report", "run_target", "run_targets"]

TARGETS = ("idlekeeper", "idlekeeper-streams", "mosquitto")
OURS = {"idlekeeper": [], "idlekeeper-streams": ["--engine", "streams"]}
"""Our targets, and the heartbeat options that make each."""
CONNACK_OK = encoders.encode_connack(False, 0)
TlsClient = trio.SSLStream[trio.SocketStream]
# Handshakes started at once per unit of --concurrency while the idle connections open.
OPEN_BATCH = 8


@dataclass(frozen=True)
class CertFiles:
    """A CA and a server certificate for localhost / 127.0.0.1, as PEM files."""

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the CA and checks the server's name."""
        return ssl.create_default_context(cafile=str(self.ca))


def make_certs(where: Path) -> CertFiles:
    """A fresh CA and server certificate in ``where``."""
    ca = trustme.CA()
    files = CertFiles(where / "ca.pem", where / "server.pem", where / "server.key")
    ca.cert_pem.write_to_path(str(files.ca))
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(str(files.cert), append=True)
    leaf.private_key_pem.write_to_path(str(files.key))
    # Mosquitto started as root drops to its own user before it reads certfile and
    # keyfile: they must be readable to it (a throwaway CA's, deleted after the run).
    where.chmod(0o755)
    for path in (files.ca, files.cert, files.key):
        path.chmod(0o644)
    return files


@dataclass(frozen=True)
class TlsLoad:
    """How big and how long a run is."""

    connections: int = 2000
    seconds: float = 10.0
    concurrency: int = 4
    open_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 15_000:
            raise ValueError("--connections must be 1..15000 (one client process holds them)")
        if not 0 < self.seconds <= 300:
            raise ValueError("--seconds must be in (0, 300]")
        if not 1 <= self.concurrency <= 64:
            raise ValueError("--concurrency must be 1..64")


@dataclass
class TlsResult:
    """One target's figures."""

    name: str
    connections: int = 0
    """Idle TLS connections held (CONNACK received)."""
    open_errors: int = 0
    rss_before: int = 0
    rss_after: int = 0
    rss_per_connection: float = math.nan
    """Bytes of server RSS per idle TLS connection."""
    open_seconds: float = 0.0
    handshakes_per_s: float = math.nan
    """Full TLS handshakes per second, ``--concurrency`` openssl s_time clients (C)."""
    handshake_cpu_ms: float = math.nan
    """Server CPU per full handshake (ms), over the s_time run: the cost, whatever the client."""
    connects_per_s: float = math.nan
    """TLS + CONNECT/CONNACK/DISCONNECT per second, Python clients (--concurrency)."""
    connect_errors: int = 0
    client_cpu: float = math.nan
    """The connect loop's CPU, in cores (1.0: one core busy: the rate is a lower bound)."""
    server_cpu: float = math.nan
    """The server's CPU over the connect loop, in cores."""
    notes: list[str] = field(default_factory=list)


def rss(pids: Sequence[int]) -> int:
    """RSS of every process of a server (a supervisor's workers included, once)."""
    return rss_bytes(processes(pids, trees=True))


def server_cpu(pids: Sequence[int]) -> float:
    """User + system CPU seconds of every process of a server."""
    return cpu_seconds(processes(pids, trees=True))


async def mqtt_over_tls(port: int, ctx: ssl.SSLContext, client_id: str) -> TlsClient:
    """A TLS connection that has sent CONNECT (keep-alive 0) and read a CONNACK 0."""
    raw = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(raw, ctx, server_hostname="localhost")
    try:
        await stream.send_all(encoders.encode_connect(client_id, keep_alive=0))
        got = b""
        while len(got) < len(CONNACK_OK):
            chunk = await stream.receive_some(4 - len(got))
            if not chunk:
                raise trio.BrokenResourceError("closed before CONNACK")
            got += chunk
        if got != CONNACK_OK:
            raise trio.BrokenResourceError(f"CONNACK {got!r}")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


async def open_idle(port: int, ctx: ssl.SSLContext, load: TlsLoad) -> tuple[list[TlsClient], int]:
    """``load.connections`` idle MQTT-over-TLS connections (and how many failed), opened
    a batch at a time, all within ``load.open_timeout``."""
    held: list[TlsClient] = []
    errors = 0
    limit = trio.CapacityLimiter(load.concurrency * OPEN_BATCH)

    async def one(i: int) -> None:
        nonlocal errors
        async with limit:
            try:
                with trio.fail_after(15):
                    held.append(await mqtt_over_tls(port, ctx, f"tls-idle-{i}"))
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError):
                errors += 1

    with trio.move_on_after(load.open_timeout):
        async with trio.open_nursery() as nursery:
            for i in range(load.connections):
                nursery.start_soon(one, i)
    return held, errors


async def connect_loop(port: int, ctx: ssl.SSLContext, load: TlsLoad) -> tuple[int, int, float]:
    """(connects completed, errors, seconds measured): ``load.concurrency`` clients, each
    connecting, handshaking, CONNECT/CONNACK, DISCONNECT and close, for ``load.seconds``."""
    done = 0
    errors = 0
    start = trio.current_time()
    end = start + load.seconds

    async def client(k: int) -> None:
        nonlocal done, errors
        n = 0
        while trio.current_time() < end:
            n += 1
            try:
                with trio.fail_after(10):
                    stream = await mqtt_over_tls(port, ctx, f"tls-rate-{k}-{n}")
                    await stream.send_all(encoders.encode_disconnect())
                    await trio.aclose_forcefully(stream)
                done += 1
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError):
                errors += 1
                await trio.sleep(0.01)  # a refusing server must not be hammered in a tight loop

    with trio.move_on_after(load.seconds + 15):
        async with trio.open_nursery() as nursery:
            for k in range(load.concurrency):
                nursery.start_soon(client, k)
    return done, errors, trio.current_time() - start


_S_TIME = re.compile(r"(\d+) connections in")


def s_time(port: int, ca: Path, seconds: float, clients: int) -> tuple[int, float] | None:
    """(full handshakes, wall seconds) by ``clients`` ``openssl s_time -new`` processes
    run side by side for ``seconds``; None if openssl is missing or every one failed.
    The wall time is ours: s_time reports whole seconds only."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    command = [openssl, "s_time", "-connect", f"127.0.0.1:{port}", "-new", "-time", str(max(1, round(seconds)))]
    command += ["-CAfile", str(ca), "-verify", "1"]
    started = time.monotonic()
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(clients)
    ]
    total = 0
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            proc.kill()  # by PID
            proc.wait()
            continue
        found = _S_TIME.search(out)
        if found is not None:
            total += int(found.group(1))
    elapsed = time.monotonic() - started
    return (total, elapsed) if total else None


def start_target(name: str, certs: CertFiles) -> MqttTarget:
    """Start ``name`` with a TLS listener on a free loopback port."""
    port = free_port()
    if name == "mosquitto":
        # The listener line comes first in start_mosquitto's file, so these apply to it.
        # set_tcp_nodelay: trio sets TCP_NODELAY on every socket, Mosquitto only when told;
        # without it Nagle holds its CONNACK ~40 ms behind a delayed ACK, which would
        # measure the kernel's timers, not the broker.
        tls = f"certfile {certs.cert}\nkeyfile {certs.key}\n"
        return start_mosquitto("mosquitto-tls", port, tls + "set_tcp_nodelay true\n")
    if name in OURS:
        extra = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), *OURS[name]]
        # Every worker writes at most a log line per refused handshake: none here.
        return MqttTarget(name, start_heartbeat(port, 1, extra, timeout=60), port)
    raise PeerUnavailable(f"unknown TLS target {name!r}")


def run_target(name: str, load: TlsLoad, certs: CertFiles, say: Callable[[str], None] = print) -> TlsResult:
    """Measure one target: a fresh server for the idle connections, the same for the rates."""
    result = TlsResult(name)
    target = start_target(name, certs)
    try:
        pids = target.pids()
        ctx = certs.client_context()
        time.sleep(0.5)
        result.rss_before = rss(pids)
        started = time.monotonic()
        held, result.open_errors = trio.run(open_idle, target.port, ctx, load)
        result.open_seconds = time.monotonic() - started
        result.connections = len(held)
        time.sleep(1.0)  # let the server settle (its garbage collector, freeze) before the reading
        result.rss_after = rss(pids)
        if held:
            result.rss_per_connection = (result.rss_after - result.rss_before) / len(held)
        say(
            f"{name}: {len(held)} idle TLS connections ({result.open_errors} failed) in {result.open_seconds:.1f} s, "
            f"RSS {result.rss_before / 2**20:.1f} -> {result.rss_after / 2**20:.1f} MiB, "
            f"{figure(result.rss_per_connection / 1024, '.2f', ' KiB', why='none held')} each"
        )
        trio.run(_close_all, held)
        time.sleep(0.5)
        server_before = server_cpu(pids)
        measured = s_time(target.port, certs.ca, load.seconds, load.concurrency)
        if measured is None:
            result.notes.append("openssl s_time unavailable or failed")
        else:
            handshakes, elapsed = measured
            result.handshakes_per_s = handshakes / elapsed
            result.handshake_cpu_ms = (server_cpu(pids) - server_before) / handshakes * 1000
        say(
            f"{name}: openssl s_time -new x{load.concurrency}: "
            f"{figure(result.handshakes_per_s, '.0f', why='; '.join(result.notes))} full handshakes/s, "
            f"{figure(result.handshake_cpu_ms, '.2f', ' ms')} of server CPU each"
        )
        me = psutil.Process()
        client_before = sum(me.cpu_times()[:2])
        server_before = server_cpu(pids)
        done, result.connect_errors, elapsed = trio.run(connect_loop, target.port, ctx, load)
        result.client_cpu = (sum(me.cpu_times()[:2]) - client_before) / elapsed
        result.server_cpu = (server_cpu(pids) - server_before) / elapsed
        result.connects_per_s = done / elapsed
        say(
            f"{name}: {result.connects_per_s:.0f} MQTT connects/s over TLS ({result.connect_errors} errors), "
            f"client {result.client_cpu:.0%} / server {result.server_cpu:.0%} of a core"
        )
    finally:
        target.stop()
    return result


def run_targets(
    names: Sequence[str], load: TlsLoad, say: Callable[[str], None] = print
) -> tuple[dict[str, TlsResult], dict[str, str]]:
    """Each target in turn, with one fresh CA and server certificate for all: the
    results, and why each target that could not run did not."""
    results: dict[str, TlsResult] = {}
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ik-tls-") as tmp:
        certs = make_certs(Path(tmp))
        for name in names:
            try:
                results[name] = run_target(name, load, certs, say)
            except PeerUnavailable as exc:
                missing[name] = str(exc)
                say(f"{name}: skipped ({exc})")
    return results, missing


async def _close_all(streams: list[TlsClient]) -> None:
    for stream in streams:
        await trio.aclose_forcefully(stream)


def report(results: dict[str, TlsResult], load: TlsLoad) -> str:
    """A Markdown table of the figures, and ours over Mosquitto's as ratios."""
    lines = [
        f"MQTT over TLS, {load.connections} idle connections; rates over {load.seconds:g} s "
        f"({plural(load.concurrency, 'concurrent client')} for connects/s)",
        "",
        "| target | idle TLS conns | RSS per conn (KiB) | full handshakes/s (s_time) | server CPU per handshake (ms) "
        "| MQTT connects/s | client CPU | server CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r.name} | {r.connections} | {figure(r.rss_per_connection / 1024, '.2f', missing='—')} "
            f"| {figure(r.handshakes_per_s, '.0f', missing='—')} | {figure(r.handshake_cpu_ms, '.2f', missing='—')} "
            f"| {figure(r.connects_per_s, '.0f', missing='—')} | {figure(r.client_cpu, '.0%', missing='—')} "
            f"| {figure(r.server_cpu, '.0%', missing='—')} |"
        )
    theirs = results.get("mosquitto")
    mine = [r for name, r in results.items() if name in OURS]
    if theirs is not None and mine:

        def row(what: str, of: Callable[[TlsResult], float]) -> str:
            return f"| {what} | " + " | ".join(ratio(of(r), of(theirs), "x", "-") for r in mine) + " |"

        lines += [
            "",
            "| ours / Mosquitto | " + " | ".join(r.name for r in mine) + " |",
            "|---|" + "---|" * len(mine),
            row("RSS per idle TLS connection", lambda r: r.rss_per_connection),
            row("full handshakes/s", lambda r: r.handshakes_per_s),
            row("server CPU per handshake", lambda r: r.handshake_cpu_ms),
            row("MQTT connects/s over TLS", lambda r: r.connects_per_s),
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest tls``; exit 0 if our server held every connection without error."""
    p = command_parser("python -m loadtest tls", __doc__)
    a = p.add_argument
    a("--connections", type=int, default=2000, help="idle TLS connections per target (default: 2000)")
    a("--seconds", type=float, default=10.0, help="seconds per handshake-rate measurement (default: 10)")
    a("--concurrency", type=int, default=4, help="clients in the connect loop (default: 4)")
    add_targets(p, TARGETS)
    add_json(p, "results/tls.json", table=True)
    add_quiet(p, live=False)
    args = p.parse_args(argv)
    try:
        load = TlsLoad(**fields_from(args, ("connections", "seconds", "concurrency")))
    except ValueError as exc:
        p.error(str(exc))
    say: Callable[[str], None] = (lambda line: None) if args.quiet else print
    results, missing = run_targets(args.targets.split(","), load, say)
    table = report(results, load)
    out = {"load": asdict(load), "runs": {k: asdict(v) for k, v in results.items()}, "missing": missing}
    path = write_json(args.json, out)
    md = write_table(path, table)
    print("\n" + table)
    print(f"\nwritten {path}, {md}")
    ours = results.get("idlekeeper")
    if ours is None:
        return 1 if "idlekeeper" in args.targets.split(",") else 0
    return 0 if ours.open_errors == 0 and ours.connections == load.connections else 1


if __name__ == "__main__":
    sys.exit(main())
