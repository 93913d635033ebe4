"""``python -m servers.heartbeat``: the MQTT 3.1.1 keep-alive presence server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import trio

from .. import runner
from ..bearer import TokenFile, TokenFileError
from ..bus import Hub
from ..config import HelpFormatter, add_log_level, add_worker_arguments, configure_logging
from ..gcpolicy import freeze_on_keeper
from ..listeners import open_listeners
from ..readiness import Ready
from ..tls import add_tls_arguments, check_tls_arguments
from ..workers import supervisor_pid
from .cli_limits import add_limit_arguments, limits_from
from .config import ENGINES, KEEPALIVE_OVER_MAX, HeartbeatConfig
from .coordination import Coordinator
from .coordination.authority import Authority
from .coordination.local import BusCoordinator
from .mqtt.policy import DEFAULT_PRESENCE_PREFIX, LEGACY_PRESENCE_PREFIX, check_presence_prefix
from .presence.event import PresenceLog, PresenceSink
from .security.acl import AclFile
from .security.passwords import PasswordFile
from .security.throttle import ThrottlePolicy
from .server.access import acl_reader
from .server.lifecycle import DRAIN_CAP, HeartbeatServer
from .server.stores import mqtt_state
from .worker import serve_heartbeat

DESCRIPTION = """\
MQTT 3.1.1 keep-alive presence server. Devices connect with any MQTT client;
a device silent for 1.5 x its keep-alive is declared dead, its Will is published,
and an offline event goes to subscribers of $SYS/presence/<client-id> (which '#'
does not match: subscribe to $SYS/presence/#), to the presence log and to the
status endpoint. Built on idlekeeper: one timing wheel and one
reaper task per worker process."""


def parser() -> argparse.ArgumentParser:
    """The command line, documented in --help and docs/reference/cli.md."""
    p = argparse.ArgumentParser(
        prog="python -m servers.heartbeat", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_worker_arguments(p, port=1883)
    a = p.add_argument
    a(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds a new socket has to complete CONNECT (default: 10)",
    )
    a(
        "--max-idle",
        type=float,
        default=3600.0,
        help="idle cap in seconds for clients with keep-alive 0; 0 disables it (default: 3600)",
    )
    a(
        "--max-keepalive",
        type=int,
        default=3600,
        help="server-side cap on a client's keep-alive, in seconds: an MQTT 5 client asking more, or 0, "
        "is told this one (Server Keep Alive); a 3.1.1 client is held to it untold (default: 3600)",
    )
    a(
        "--keepalive-over-max",
        choices=KEEPALIVE_OVER_MAX,
        default="cap",
        help="a 3.1.1/3.1 client asking more than --max-keepalive cannot be told: cap holds it to 1.5 x the "
        "maximum (dead devices are found in time; one that pings slower is cut and reconnects), honour "
        "keeps its own, refuse answers CONNACK 2 as Mosquitto 2.0.12+ (default: cap)",
    )
    a(
        "--max-topic-alias",
        type=int,
        default=10,
        help="topic aliases an MQTT 5 client may set towards the server; 0: none (default: 10, as Mosquitto)",
    )
    a(
        "--ws-port",
        type=int,
        default=None,
        help="also serve MQTT over WebSockets on this port (browsers' only way in: MQTT.js, Paho JavaScript);"
        " wss with --tls-cert; a task per connection whatever --engine (default: none)",
    )
    a("--ws-path", default="/mqtt", help="the request path the WebSocket listener serves (default: /mqtt)")
    a(
        "--ws-allowed-origins",
        default=None,
        help="comma-separated browser origins let in (https://dash.example.com): a page from any other is"
        " refused 403 (cross-site WebSocket hijacking); clients that send no Origin are not browsers"
        " (default: any origin)",
    )
    a(
        "--outbound-topic-aliases",
        choices=("on", "off"),
        default="on",
        help="on: name a topic once, then by alias, to an MQTT 5 client whose CONNECT allows aliases"
        " (its Topic Alias Maximum); off: always the whole topic, as Mosquitto (default: on)",
    )
    a(
        "--engine",
        choices=ENGINES,
        default="dense",
        help="dense: one task serves every connection (the default, ~1 KiB per device); "
        "streams: a trio task per connection (default: dense)",
    )
    a(
        "--coalesce",
        type=float,
        default=0.0,
        help="dense engine: while packets keep coming, serve them in one pass every this many seconds "
        "instead of one wake-up each (less CPU per heartbeat, replies up to that much later; default: 0)",
    )
    a(
        "--coalesce-pings",
        type=float,
        default=0.0,
        help="dense engine: while nothing but PINGREQs comes, serve them in one pass every this many seconds "
        "(a fleet's heartbeats cost a wake-up a window; a packet that arrives meanwhile waits up to that "
        "long; any other traffic is served at once; default: 0)",
    )
    a(
        "--trio-waits",
        action="store_true",
        help="dense engine: always wait for the sockets through trio's loop, never on the engine's own "
        "epoll set while trio is idle (more CPU a wake-up; for comparison; see idlekeeper.open_engine)",
    )
    a("--send-timeout", type=float, default=30.0, help="seconds a subscriber may stall our sends (default: 30)")
    a("--max-packet-size", type=int, default=256 * 1024, help="largest accepted packet in bytes (default: 262144)")
    a(
        "--max-connections",
        type=int,
        default=18_000,
        help="devices per worker; beyond it CONNECT gets CONNACK 3 (default: 18000, under the 20,000-file limit)",
    )
    a(
        "--status-port",
        type=int,
        default=None,
        help="HTTP status port (/healthz, /metrics, /devices/<id>); worker i serves on this port + i",
    )
    a("--status-host", default="127.0.0.1", help="status endpoint address (default: loopback only)")
    a(
        "--status-token-file",
        default=None,
        metavar="PATH",
        help="bearer tokens, one a line (# comments), one of which /metrics and /devices then need in "
        "'Authorization: Bearer <token>' (401 otherwise); /healthz stays open; reloaded on SIGHUP "
        "(default: no authentication)",
    )
    a(
        "--auth-file",
        default=None,
        help="password file: our PBKDF2 entries (python -m servers.heartbeat.auth add ...) and Mosquitto's "
        "$7$ and $6$ (mosquitto_passwd), mixed as you like",
    )
    a(
        "--auth-free-failures",
        type=int,
        default=5,
        help="failed password checks a source address, or a username, may make before its checks are "
        "delayed (default: 5)",
    )
    a(
        "--auth-max-delay",
        type=float,
        default=60.0,
        help="longest delay, in seconds, between checks of a source address or username that keeps failing "
        "(1 s after the last free failure, doubling); meanwhile its CONNECTs are refused unchecked; "
        "0 disables throttling (default: 60)",
    )
    a("--auth-threads", type=int, default=1, help="passwords hashed at once, each in a thread (default: 1)")
    a(
        "--acl-file",
        default=None,
        help="access rules in Mosquitto's acl_file format (user, topic, pattern with %%c and %%u); "
        "reloaded on SIGHUP (default: any client may subscribe and publish anywhere)",
    )
    a("--presence-log", default=None, help="write presence events as JSON lines to this file, or - for stdout")
    a(
        "--presence-prefix",
        type=presence_prefix,
        default=DEFAULT_PRESENCE_PREFIX,
        metavar="PREFIX",
        help="topic prefix of presence events: each device's is PREFIX<client-id>, and no client may publish "
        "there; it must end with '/' and hold no +, # or NUL. Under $ (the default), subscribers to '#' or "
        f"'+/...' do not get presence; {LEGACY_PRESENCE_PREFIX} keeps the topics of earlier versions "
        "(default: %(default)s)",
    )
    a(
        "--gc-freeze",
        type=float,
        default=2.0,
        help="seconds between freezing long-lived objects out of the garbage collector's scans; 0: never (default: 2)",
    )
    add_log_level(p)
    a(
        "--cluster",
        default=None,
        metavar="URL",
        help="share presence with a fleet of gateways on Redis >= 7: one server, redis://HOST:PORT/DB "
        "(rediss:// for TLS); through Sentinels, following a failover, "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]; or a Redis Cluster, "
        "redis+cluster://HOST:PORT[,HOST:PORT...][/?shards=N]; credentials as USER:PASSWORD@ before the "
        "first HOST (default: this machine only, no external service)",
    )
    a("--node", default=None, help="this gateway's name in the fleet (default: HOST:PORT); each worker is NODE/wI")
    a(
        "--lease",
        type=float,
        default=10.0,
        help="seconds a fleet node's lease lives without renewal (renewed every second); a gateway that "
        "dies is declared lost this long after (default: 10; shorter finds dead gateways sooner, but a "
        "gateway too busy to renew in time is declared lost while alive)",
    )
    a("--max-qos", type=int, choices=(0, 1, 2), default=2, help="highest QoS granted and routed (default: 2)")
    a(
        "--max-inflight",
        type=int,
        default=20,
        help="QoS 1 and 2 messages sent to a client and not yet acknowledged, at most (default: 20)",
    )
    a(
        "--max-queued",
        type=int,
        default=1000,
        help="QoS 1 and 2 messages queued per client behind those in flight, and while a persistent "
        "session's client is away; beyond it new ones are dropped and counted (default: 1000)",
    )
    a(
        "--max-queued-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="bytes queued per client likewise (default: 16 MiB)",
    )
    a(
        "--max-subscriber-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="bytes queued for one subscriber's socket; beyond, its QoS 0 messages are dropped and counted, "
        "and a subscriber that stays beyond for --send-timeout or falls behind by twice this is "
        "disconnected (send-overflow) (default: 16 MiB)",
    )
    a(
        "--max-outbox-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="bytes queued for all subscribers' sockets in one worker; beyond, QoS 0 messages are dropped "
        "and counted, and the subscriber holding the most is disconnected if it is behind by more than "
        "its own bound (default: 256 MiB)",
    )
    a(
        "--session-expiry",
        type=float,
        default=86400.0,
        help="seconds a 3.1.1 persistent session (CleanSession=0) is kept after its client left, and the most an"
        " MQTT 5 client's Session Expiry Interval is granted (default: 86400)",
    )
    a(
        "--no-retain-presence",
        action="store_true",
        help="do not retain presence events (by default a new subscription to $SYS/presence/# first gets "
        "every device's last event, then the live stream)",
    )
    a(
        "--presence-offline-ttl",
        type=float,
        default=7 * 24 * 3600.0,
        help="seconds an offline device's presence stays retained; 0: as long as its record is kept (default: 604800)",
    )
    a(
        "--max-retained-bytes",
        type=int,
        default=512 * 1024 * 1024,
        help="bytes of retained topics and payloads kept (presence not included); beyond, new ones are "
        "refused and counted (default: 512 MiB)",
    )
    add_limit_arguments(p)
    add_tls_arguments(p, client_certificates=True)
    a("--bus", default=None, help=argparse.SUPPRESS)
    a("--bus-buffer", type=int, default=64 * 1024 * 1024, help=argparse.SUPPRESS)
    return p


def presence_prefix(text: str) -> str:
    """``--presence-prefix``, checked (:func:`~.mqtt.policy.check_presence_prefix`)."""
    try:
        return check_presence_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from(args: argparse.Namespace, worker: int) -> HeartbeatConfig:
    """A worker's configuration from the parsed command line."""
    cfg = HeartbeatConfig.from_args(
        args,
        worker,
        connect_timeout=args.connect_timeout,
        max_idle=args.max_idle or None,
        max_keepalive=args.max_keepalive,
        keepalive_over_max=args.keepalive_over_max,
        send_timeout=args.send_timeout,
        max_packet_size=args.max_packet_size,
        max_connections=args.max_connections,
        engine=args.engine,
        coalesce=args.coalesce,
        coalesce_pings=args.coalesce_pings,
        direct_wait=not args.trio_waits,
        auth=PasswordFile.load(args.auth_file) if args.auth_file else None,
        auth_throttle=auth_throttle(args),
        auth_threads=args.auth_threads,
        acl=AclFile.load(args.acl_file) if args.acl_file else None,
        max_qos=args.max_qos,
        max_inflight=args.max_inflight,
        max_topic_alias=args.max_topic_alias,
        outbound_topic_aliases=args.outbound_topic_aliases == "on",
        ws_port=args.ws_port,
        ws_path=args.ws_path,
        ws_allowed_origins=(
            None
            if args.ws_allowed_origins is None
            else frozenset(o.strip().lower() for o in args.ws_allowed_origins.split(",") if o.strip())
        ),
        max_queued=args.max_queued,
        max_queued_bytes=args.max_queued_bytes,
        max_subscriber_bytes=args.max_subscriber_bytes,
        max_outbox_bytes=args.max_outbox_bytes,
        session_expiry=args.session_expiry,
        retain_presence=not args.no_retain_presence,
        presence_offline_ttl=args.presence_offline_ttl or None,
        presence_prefix=args.presence_prefix,
        max_retained_bytes=args.max_retained_bytes,
        **limits_from(args),
    )
    if args.cluster:
        # One node per worker *process*: a worker that crashed and was restarted is a
        # new node, and the old one's devices are swept (node-lost) when its lease lapses.
        cfg.node = f"{args.node or f'{args.host}:{args.port}'}/w{worker}/{os.getpid()}"
    if args.presence_log and not args.bus and not args.cluster:
        cfg.extra_sinks.append(PresenceLog(args.presence_log))
    return cfg


def auth_throttle(args: argparse.Namespace) -> ThrottlePolicy | None:
    """The throttling of failed password checks the command line asks for (None: off)."""
    cap = args.auth_max_delay
    if cap <= 0:
        return None
    return ThrottlePolicy(free=args.auth_free_failures, base=min(1.0, cap), cap=cap, forget=max(900.0, cap))


def coordinator_for(args: argparse.Namespace, config: HeartbeatConfig) -> tuple[Coordinator | None, list[PresenceSink]]:
    """The worker's coordinator (None: a lone worker's default) and the sinks it owns."""
    if args.cluster:
        from .coordination.fleet import RedisCoordinator  # coredis only when asked for

        # Each worker is a node of the fleet; it writes the events it publishes itself.
        own: list[PresenceSink] = [PresenceLog(args.presence_log)] if args.presence_log else []
        fleet = RedisCoordinator(
            args.cluster,
            config.node,
            sinks=own,
            presence_prefix=config.presence_prefix,
            lease=args.lease,
            max_qos=config.max_qos,
            max_inflight=config.max_inflight,
            max_queued=config.max_queued,
            max_queued_bytes=config.max_queued_bytes,
            session_expiry=config.session_expiry,
            max_sessions=config.max_persistent_sessions,
            may_read=acl_reader(config),
            retain_presence=config.retain_presence,
            presence_offline_ttl=config.presence_offline_ttl,
            max_retained_bytes=config.max_retained_bytes,
            max_retained_per_client=config.max_retained_per_client,
            max_retained_bytes_per_client=config.max_retained_bytes_per_client,
        )
        return fleet, own
    if not args.bus:
        return None, list(config.extra_sinks)
    # The supervisor's authority writes the log; the worker keeps it for when it is gone.
    sinks: list[PresenceSink] = [PresenceLog(args.presence_log)] if args.presence_log else []
    bus = BusCoordinator(
        args.bus,
        worker=config.worker,
        supervisor_pid=supervisor_pid(),
        sinks=sinks,
        presence_prefix=config.presence_prefix,
    )
    return bus, sinks


def authority_hub(args: argparse.Namespace) -> Hub:
    """The supervisor's hub, whose authority keeps the registry and writes the presence log."""
    sinks: list[PresenceSink] = [PresenceLog(args.presence_log)] if args.presence_log else []
    # The bounds and rules of the sessions it keeps for every worker (the log is its own, above).
    config = config_from(argparse.Namespace(**{**vars(args), "presence_log": None}), 0)
    authority = Authority(
        sinks,
        presence_prefix=config.presence_prefix,
        max_records=config.max_device_records,
        max_record_bytes=config.max_device_record_bytes,
        state=mqtt_state(config),
    )
    return Hub(authority, max_buffer=args.bus_buffer)


async def run_worker(args: argparse.Namespace, worker: int, reuse_port: bool) -> None:
    """One worker: serve until SIGINT or SIGTERM, then shut down cleanly."""
    config = config_from(args, worker)
    coordinator, sinks = coordinator_for(args, config)
    listeners = open_listeners(args.host, args.port, reuse_port=reuse_port)
    if reuse_port and args.ws_port == 0:
        raise SystemExit("--ws-port 0 (any free port) needs --workers 1: the workers share one port")
    ws_listeners = None if args.ws_port is None else open_listeners(args.host, args.ws_port, reuse_port=reuse_port)
    status_port = None if args.status_port is None else args.status_port + worker
    # The box's other workers, whose figures this worker's page shows beside its own.
    siblings = [] if status_port is None else [args.status_port + i for i in range(args.workers) if i != worker]
    status_tokens = TokenFile.load(args.status_token_file) if args.status_token_file else None

    async def start(nursery: trio.Nursery) -> HeartbeatServer:
        server: HeartbeatServer = await nursery.start(
            lambda task_status: serve_heartbeat(
                config,
                listeners=listeners,
                ws_listeners=ws_listeners,
                status_port=status_port,
                status_host=args.status_host,
                status_tokens=status_tokens,
                status_siblings=siblings,
                coordinator=coordinator,
                task_status=task_status,
            )
        )
        if args.gc_freeze > 0:
            freeze_on_keeper(server.keeper, args.gc_freeze)  # ends with the keeper
        return server

    def ready(server: HeartbeatServer) -> Ready:
        status_host = args.status_host if status_port is not None else None
        return Ready("heartbeat", worker, args.host, server.port, status_host, status_port)

    def reload(server: HeartbeatServer) -> None:
        server.reload_acl()
        if status_tokens is not None:
            status_tokens.reload()

    # Devices end first and subscribers hear it; then the subscribers are closed.
    await runner.serve_until_signal(start, ready, stop=HeartbeatServer.shutdown, reload=reload)
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is not None:
            close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a single worker, or a supervisor of ``--workers`` workers."""
    cli = parser()
    args = cli.parse_args(argv)
    check_tls_arguments(cli, args)
    if args.status_token_file:
        if args.status_port is None:
            cli.error("--status-token-file needs --status-port")
        try:
            TokenFile.load(args.status_token_file)  # a bad file is told here, once, not by every worker
        except TokenFileError as exc:
            cli.error(str(exc))
    if args.cluster:
        from .coordination.fleet.target import parse_target

        try:
            parse_target(args.cluster)  # told here, once, not by every worker
        except ValueError as exc:
            cli.error(f"--cluster: {exc}")
    configure_logging(args.log_level)
    if not args.presence_prefix.startswith("$") and args.worker_index is None:
        logging.getLogger("servers.heartbeat").warning(
            "presence is published under %s, which '#' matches: every subscriber to '#' gets every device's "
            "presence (the default, %s, is kept from wildcard subscribers)",
            args.presence_prefix,
            DEFAULT_PRESENCE_PREFIX,
        )
    # In a fleet the workers share through Redis, so the supervisor needs no authority.
    hub = None if args.cluster else (lambda: authority_hub(args))
    # A worker's shutdown may wait up to DRAIN_CAP for a fleet reader a backlog behind,
    # within its own bounds: the supervisor waits as long before it kills.
    return runner.main("servers.heartbeat", args, argv, run_worker, hub=hub, grace=DRAIN_CAP + 15.0)


if __name__ == "__main__":
    sys.exit(main())
