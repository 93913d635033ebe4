"""``idlekeeper-heartbeat`` (``python -m servers.heartbeat``): the MQTT keep-alive presence server."""

from __future__ import annotations

from ..extras import require

require("idlekeeper-heartbeat", "servers")  # before the imports that need it

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

import trio

from .. import runner
from ..bearer import TokenFile, TokenFileError
from ..bus import Hub
from ..conffile import ConfigError
from ..config import configure_logging
from ..gcpolicy import freeze_on_keeper
from ..readiness import Ready
from ..settings import CommandLine, command_line
from ..tls import check_tls_arguments, tls_options
from ..workers import supervisor_pid
from .conf import expand_config
from .config import HeartbeatConfig
from .coordination import Coordinator
from .coordination.authority import Authority
from .coordination.durable import StoreFileError, lock_store, open_database
from .coordination.local import BusCoordinator
from .listener import ListenerConfig, ListenerError, ListenerSpec
from .mqtt.policy import DEFAULT_PRESENCE_PREFIX
from .presence.event import PresenceLog, PresenceSink
from .security.acl import AclFile, AclFileError
from .security.passwords import AuthFileError, PasswordFile
from .security.throttle import ThrottlePolicy
from .server.access import acl_reader
from .server.lifecycle import DRAIN_CAP, HeartbeatServer, connection_log
from .server.stores import durability_for, mqtt_state
from .settings import SETTINGS, limits_from
from .worker import serve_heartbeat

DESCRIPTION = """\
MQTT 3.1, 3.1.1 and 5.0 keep-alive presence server. Devices connect with any MQTT client;
a device silent for 1.5 x its keep-alive is declared dead, its Will is published,
and an offline event goes to subscribers of $SYS/presence/<client-id> (which '#'
does not match: subscribe to $SYS/presence/#), to the presence log and to the
status endpoint. Built on idlekeeper: one timing wheel and one
reaper task per worker process."""


def parser() -> CommandLine:
    """The command line (:data:`.settings.SETTINGS`), documented in --help and docs/reference/cli.md."""
    return command_line("idlekeeper-heartbeat", "servers.heartbeat", DESCRIPTION, SETTINGS)


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
        max_inflight_bytes=args.max_inflight_bytes,
        max_topic_alias=args.max_topic_alias,
        outbound_topic_aliases=args.outbound_topic_aliases == "on",
        listeners=listeners_from(args),
        bridges=list(args.bridge or ()),
        allow_anonymous=None if args.allow_anonymous is None else args.allow_anonymous == "true",
        allow_zero_length_clientid=args.allow_zero_length_clientid == "true",
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
        sys_interval=args.sys_interval,
        presence_prefix=args.presence_prefix,
        max_retained_bytes=args.max_retained_bytes,
        retain_available=args.retain_available == "true",
        message_size_limit=args.message_size_limit,
        persistence=args.persistence,
        persistence_sync=args.persistence_sync,
        persistence_interval=args.persistence_interval,
        autosave_interval=args.autosave_interval,
        persistence_check=False,  # check_arguments read it through, before anything started
        **limits_from(args),
    )
    if args.cluster:
        # One node per worker *process*: a worker that crashed and was restarted is a
        # new node, and the old one's devices are swept (node-lost) when its lease lapses.
        cfg.node = f"{args.node or f'{args.host}:{args.port}'}/w{worker}/{os.getpid()}"
    if args.presence_log and not args.bus and not args.cluster:
        cfg.extra_sinks.append(PresenceLog(args.presence_log))
    return cfg


def listeners_from(args: argparse.Namespace) -> list[ListenerConfig] | None:
    """The listeners the command line names (None: the default ones, on --port and
    --ws-port). With ``--listener``, --port and --ws-port are served too only if given."""
    specs: list[ListenerSpec] = args.listener
    if not specs:
        return None
    timeout = args.tls_handshake_timeout
    tls = tls_options(args)
    given = list(specs)
    # The supervisor passes its workers the first listener as their --port: the same
    # address and port are one listener, not two.
    if getattr(args, "port_given", True) and all((s.address, s.port) != (args.host, args.port) for s in specs):
        given.insert(0, ListenerSpec.serving(args.port, args.host, tls))
    if args.ws_port is not None:
        given.append(ListenerSpec.serving(args.ws_port, args.host, tls, "websockets"))
    return [ListenerConfig.load(spec, timeout) for spec in given]


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
            max_inflight_bytes=config.max_inflight_bytes,
            max_queued=config.max_queued,
            max_queued_bytes=config.max_queued_bytes,
            session_expiry=config.session_expiry,
            max_sessions=config.max_persistent_sessions,
            may_read=acl_reader(config, config.listeners or ()),
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
        durable=config.persistence is not None and config.persistence_sync == "always",
        keeps_wills=config.persistence is not None,
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
        durability=durability_for(config, time.time),
    )
    return Hub(authority, max_buffer=args.bus_buffer)


async def run_worker(args: argparse.Namespace, worker: int, reuse_port: bool) -> None:
    """One worker: serve until SIGINT or SIGTERM, then shut down cleanly."""
    config = config_from(args, worker)
    coordinator, sinks = coordinator_for(args, config)
    status_port = None if args.status_port is None else args.status_port + worker
    # The box's other workers, whose figures this worker's page shows beside its own.
    siblings = [] if status_port is None else [args.status_port + i for i in range(args.workers) if i != worker]
    status_tokens = TokenFile.load(args.status_token_file) if args.status_token_file else None

    async def start(nursery: trio.Nursery) -> HeartbeatServer:
        server: HeartbeatServer = await nursery.start(
            lambda task_status: serve_heartbeat(
                config,
                reuse_port=reuse_port,
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
        server.reload_files()
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
    try:
        # -c FILE: the file's settings, as arguments the command line's own come after.
        words, warnings = expand_config(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as exc:
        cli.error(str(exc))
    args = cli.parse_args(words)
    if args.worker_index is None:  # the supervisor's workers read the file again: told once
        for warning in warnings:
            print(f"{cli.prog}: warning: {warning}", file=sys.stderr)
    # With a --listener, --port is one more only when asked for; else the first listener
    # stands for it (the port checked free, the one a supervisor gives its workers).
    args.port_given = any(word == "--port" or word.startswith("--port=") for word in words)
    if args.listener and not args.port_given:
        first = args.listener[0]
        args.host, args.port = first.address, first.port
    check_arguments(cli, args)
    configure_logging(args.log_level, args.log_file)
    connection_log.disabled = not args.connection_messages
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
    return runner.main(
        "servers.heartbeat",
        args,
        argv,
        run_worker,
        hub=hub,
        grace=DRAIN_CAP + 15.0,
        extra_ports=extra_ports(args),
        prog=cli.prog,
    )


def _plain_listener(args: argparse.Namespace) -> bool:
    """Whether a plain MQTT listener (no TLS, no WebSockets) is served, for a bridge to join through."""
    specs: list[ListenerSpec] = args.listener or []
    if any(s.protocol == "mqtt" and not s.tls for s in specs):
        return True
    # The listener on --port: served without --listener, or with it when given too.
    return (not specs or getattr(args, "port_given", True)) and tls_options(args) is None


def check_arguments(cli: CommandLine, args: argparse.Namespace) -> None:
    """Refuse, in one line and before anything is bound, options that parsed alone but
    cannot work together, and files that do not load (each is told here, once, not by
    every worker)."""
    check_tls_arguments(cli, args)
    several = args.workers > 1 and args.worker_index is None
    for spec in args.listener or []:
        if several and spec.port == 0:
            cli.refuse(f"--listener {spec.name}", "any free port needs --workers 1: the workers share each port")
    if several and args.ws_port == 0:
        cli.refuse("--ws-port 0", "any free port needs --workers 1: the workers share one port")
    if several and args.status_port == 0:
        cli.refuse("--status-port 0", "any free port needs --workers 1: worker i serves on --status-port + i")
    last = args.workers - 1
    if args.status_port is not None and args.status_port + last > 65535:
        cli.refuse("--status-port", f"worker {last} would serve on port {args.status_port + last}, past 65535")
    if args.status_token_file:
        if args.status_port is None:
            cli.refuse("--status-token-file", "needs --status-port")
        try:
            TokenFile.load(args.status_token_file)
        except TokenFileError as exc:
            cli.refuse("--status-token-file", str(exc))
    if args.persistence is not None and args.worker_index is None:  # the supervisor's, not its workers'
        if args.cluster:
            cli.refuse("--persistence", "a fleet keeps its state in Redis (see docs/how-to/durability.md), not a file")
        try:
            os.close(lock_store(args.persistence))  # not in use by another server
            open_database(args.persistence).close()
        except StoreFileError as exc:
            cli.refuse("--persistence", str(exc))
    if args.cluster:
        from .coordination.fleet.target import parse_target

        try:
            parse_target(args.cluster)
        except ValueError as exc:
            cli.refuse("--cluster", str(exc))
    if args.bridge and not _plain_listener(args):
        cli.refuse("--bridge", "a bridge joins this server through a plain mqtt:// listener, and none is given")
    try:
        # Loads the password file and the ACL as a worker will, and checks the settings together.
        config_from(argparse.Namespace(**{**vars(args), "presence_log": None}), 0)
    except ListenerError as exc:
        cli.refuse("--listener", str(exc))
    except AuthFileError as exc:
        cli.refuse("--auth-file", str(exc))
    except AclFileError as exc:
        cli.refuse("--acl-file", str(exc))
    except ValueError as exc:
        cli.error(str(exc))


def extra_ports(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The ports besides MQTT's that this server (all its workers) will listen on."""
    ports = [("--listener", spec.address, spec.port) for spec in (args.listener or [])[1:]]
    if args.listener and args.port_given:
        ports.append(("--listener", args.listener[0].address, args.listener[0].port))
    if args.ws_port:
        ports.append(("--ws-port", args.host, args.ws_port))
    if args.status_port:
        first = args.status_port
        ports += [("--status-port", args.status_host, first + i) for i in range(args.workers)]
    return ports


if __name__ == "__main__":
    sys.exit(main())
