"""Every option of the heartbeat server, declared once (:mod:`servers.settings`): its
kind (type, range, unit), default and help. The command line is built from them, and
so is anything else that sets them (a Mosquitto configuration file: :mod:`..conf`).
The per-client bounds are in :mod:`.limits`, whose :func:`limits_from` turns them into
the configuration's fields."""

from __future__ import annotations

from ...config import LOG_FILE, LOG_LEVEL, worker_settings
from ...settings import Choice, Flag, Host, Path, Setting, Text, count, port, seconds
from ...tls import tls_settings
from ..bridge import parse_bridge
from ..config import DEFAULT_COALESCE_PINGS, ENGINES, KEEPALIVE_OVER_MAX
from ..coordination.durable import SYNC_MODES
from ..listener import parse_listener
from ..mqtt.packets import MAX_REMAINING_LENGTH
from ..mqtt.policy import (
    DEFAULT_PRESENCE_PREFIX,
    LEGACY_PRESENCE_PREFIX,
    check_presence_prefix,
)
from .limits import CONNECT_RATE, LIMITS, limits_from

__all__ = ["LIMITS", "SETTINGS", "limits_from"]


_MIB = 1024 * 1024


def _ws_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError(f"must be a request path starting with '/', not {text!r}")
    return text


_LISTENERS = "listeners (several at once: Mosquitto's listener sections)"
_DURABLE = "durable state (one box)"

_WS = "MQTT over WebSockets"
_STATUS = "the status endpoint (/healthz, /metrics, /devices/<id>, the operator's page)"
_AUTH = "who may connect, and what they may do"
_FLEET = "a fleet of gateways on Redis"
_QUEUES = "QoS, queues and retained messages"
_ENGINE = "the engine"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "--config",
        Path(),
        None,
        "read the settings from this file, in Mosquitto's format (mosquitto.conf: its directives, "
        "listener sections, include_dir; and each option here as a directive, --presence-prefix as "
        "presence_prefix); options on the command line override it (see docs/how-to/from-mosquitto.md)",
        aliases=("-c",),
    ),
    *worker_settings(port=1883),
    Setting("--connect-timeout", seconds(), 10.0, "seconds a new socket has to complete CONNECT (default: 10)"),
    Setting(
        "--max-idle",
        seconds(zero="no cap"),
        3600.0,
        "idle cap in seconds for clients with keep-alive 0; 0 disables it (default: 3600)",
    ),
    Setting(
        "--max-keepalive",
        count("seconds", most=65535),
        3600,
        "server-side cap on a client's keep-alive, in seconds: an MQTT 5 client asking more, or 0, "
        "is told this one (Server Keep Alive); a 3.1.1 client is held to it untold (default: 3600)",
    ),
    Setting(
        "--keepalive-over-max",
        Choice(KEEPALIVE_OVER_MAX),
        "cap",
        "a 3.1.1/3.1 client asking more than --max-keepalive cannot be told: cap holds it to 1.5 x the "
        "maximum (dead devices are found in time; one that pings slower is cut and reconnects), honour "
        "keeps its own, refuse answers CONNACK 2 as Mosquitto 2.0.12+ (default: cap)",
    ),
    Setting(
        "--max-topic-alias",
        count(least=0, most=65535),
        10,
        "topic aliases an MQTT 5 client may set towards the server; 0: none (default: 10, as Mosquitto)",
    ),
    Setting(
        "--outbound-topic-aliases",
        Choice(("on", "off")),
        "on",
        "on: name a topic once, then by alias, to an MQTT 5 client whose CONNECT allows aliases"
        " (its Topic Alias Maximum); off: always the whole topic, as Mosquitto (default: on)",
    ),
    Setting("--send-timeout", seconds(), 30.0, "seconds a subscriber may stall our sends (default: 30)"),
    Setting(
        "--max-packet-size",
        count("bytes", least=64, most=MAX_REMAINING_LENGTH),
        256 * 1024,
        "largest accepted packet in bytes (default: 262144)",
    ),
    Setting(
        "--max-connections",
        count("connections"),
        18_000,
        "devices per worker; beyond it CONNECT gets CONNACK 3 (default: 18000, under the 20,000-file limit)",
    ),
    Setting(
        "--presence-log",
        Path("append"),
        None,
        "write presence events as JSON lines to this file, or - for stdout",
    ),
    Setting(
        "--presence-prefix",
        Text(check_presence_prefix),
        DEFAULT_PRESENCE_PREFIX,
        "topic prefix of presence events: each device's is PREFIX<client-id>, and no client may publish "
        "there; it must end with '/' and hold no +, # or NUL. Under $ (the default), subscribers to '#' or "
        f"'+/...' do not get presence; {LEGACY_PRESENCE_PREFIX} keeps the topics of earlier versions "
        "(default: %(default)s)",
        metavar="PREFIX",
    ),
    Setting(
        "--no-retain-presence",
        Flag(),
        False,
        "do not retain presence events (by default a new subscription to $SYS/presence/# first gets "
        "every device's last event, then the live stream)",
    ),
    Setting(
        "--presence-offline-ttl",
        seconds(zero="as long as its record is kept"),
        7 * 24 * 3600.0,
        "seconds an offline device's presence stays retained; 0: as long as its record is kept (default: 604800)",
    ),
    Setting(
        "--sys-interval",
        seconds(least=0.0, zero="off"),
        10.0,
        "seconds between updates of the $SYS/broker/... statistics, Mosquitto's topics and formats "
        "(docs/reference/sys-topics.md); 0: none are published (default: 10)",
    ),
    LOG_LEVEL,
    LOG_FILE,
    Setting(
        "--connection-messages",
        Flag(),
        False,
        "log each client's connection and disconnection at INFO, as Mosquitto's connection_messages: "
        "'New client connected from HOST:PORT as ID (p2, c1, k60, u'name').' (off by default: a line per "
        "device is much at this server's scale)",
    ),
    Setting(
        "--listener",
        Text(parse_listener, metavar="URL"),
        None,
        "a listener, given once for each: mqtt://ADDRESS:PORT, ws://ADDRESS:PORT (MQTT over WebSockets), "
        "with ?certfile=..&keyfile=.. for TLS (mqtts://, wss://) and any of Mosquitto's listener options "
        "after them (cafile, require_certificate, max_connections, password_file, acl_file...; see "
        "docs/how-to/from-mosquitto.md); with a --listener, --port is served only if given too "
        "(default: one listener, on --host and --port)",
        many=True,
        group=_LISTENERS,
    ),
    Setting(
        "--bridge",
        Text(parse_bridge, metavar="URL"),
        None,
        "a bridge to another broker, given once for each (Mosquitto's connection sections): "
        "mqtt://HOST[:PORT][,HOST[:PORT]...]/NAME?topic=TOPIC[&topic=TOPIC...][&KEY=VALUE...], "
        "the topics as Mosquitto's topic directive with its blanks written %%20, the keys the "
        "section's directives (remote_username, bridge_protocol_version, keepalive_interval, "
        "restart_timeout, notifications...); mqtts:// with bridge_cafile for TLS; run by worker 0, "
        "connected to the first plain mqtt:// listener (see docs/how-to/from-mosquitto.md)",
        many=True,
        group=_LISTENERS,
    ),
    # MQTT over WebSockets.
    Setting(
        "--ws-port",
        port(),
        None,
        "also serve MQTT over WebSockets on this port (browsers' only way in: MQTT.js, Paho JavaScript);"
        " wss with --tls-cert; a task per connection whatever --engine (default: none)",
        group=_WS,
    ),
    Setting(
        "--ws-path",
        Text(_ws_path, metavar="PATH"),
        "/mqtt",
        "the request path the WebSocket listener serves (default: /mqtt)",
        group=_WS,
    ),
    Setting(
        "--ws-allowed-origins",
        Text(metavar="ORIGINS"),
        None,
        "comma-separated browser origins let in (https://dash.example.com): a page from any other is"
        " refused 403 (cross-site WebSocket hijacking); clients that send no Origin are not browsers"
        " (default: any origin)",
        group=_WS,
    ),
    # The status endpoint.
    Setting(
        "--status-port",
        port(zero="any free port; with --workers 1 only"),
        None,
        "HTTP status port (/healthz, /metrics, /devices/<id>); worker i serves on this port + i",
        group=_STATUS,
    ),
    Setting("--status-host", Host(), "127.0.0.1", "status endpoint address (default: loopback only)", group=_STATUS),
    Setting(
        "--status-token-file",
        Path(),
        None,
        "bearer tokens, one a line (# comments), one of which /metrics and /devices then need in "
        "'Authorization: Bearer <token>' (401 otherwise); /healthz stays open; reloaded on SIGHUP "
        "(default: no authentication)",
        group=_STATUS,
        metavar="PATH",
    ),
    # Who may connect.
    Setting(
        "--auth-file",
        Path(),
        None,
        "password file: our PBKDF2 entries (idlekeeper-passwd add ...) and Mosquitto's $7$ and $6$ "
        "(mosquitto_passwd), mixed as you like; reloaded on SIGHUP",
        group=_AUTH,
    ),
    Setting(
        "--auth-free-failures",
        count("failures", least=0),
        5,
        "failed password checks a source address, or a username, may make before its checks are delayed (default: 5)",
        group=_AUTH,
    ),
    Setting(
        "--auth-max-delay",
        seconds(least=0),
        60.0,
        "longest delay, in seconds, between checks of a source address or username that keeps failing "
        "(1 s after the last free failure, doubling); meanwhile its CONNECTs are refused unchecked; "
        "0 disables throttling (default: 60)",
        group=_AUTH,
    ),
    Setting(
        "--auth-threads",
        count("threads", most=256),
        1,
        "passwords hashed at once, each in a thread (default: 1)",
        group=_AUTH,
    ),
    Setting(
        "--acl-file",
        Path(),
        None,
        "access rules in Mosquitto's acl_file format (user, topic, pattern with %%c and %%u); "
        "reloaded on SIGHUP (default: any client may subscribe and publish anywhere)",
        group=_AUTH,
    ),
    Setting(
        "--allow-anonymous",
        Choice(("true", "false")),
        None,
        "whether a client without a username is let in (Mosquitto's allow_anonymous; default: true "
        "without --auth-file, false with one)",
        group=_AUTH,
    ),
    Setting(
        "--allow-zero-length-clientid",
        Choice(("true", "false")),
        "true",
        "whether a client may connect with an empty client id and be given one by the server "
        "(Mosquitto's allow_zero_length_clientid; default: true)",
        group=_AUTH,
    ),
    CONNECT_RATE,
    *LIMITS,
    *tls_settings(client_certificates=True),
    # QoS, queues and retained messages.
    Setting(
        "--max-qos",
        count(least=0, most=2),
        2,
        "highest QoS granted and routed (default: 2)",
        group=_QUEUES,
        metavar="{0,1,2}",
    ),
    Setting(
        "--max-inflight",
        count("messages", most=65535),
        20,
        "QoS 1 and 2 messages sent to a client and not yet acknowledged, at most (default: 20)",
        group=_QUEUES,
    ),
    Setting(
        "--max-inflight-bytes",
        count("bytes", least=0),
        0,
        "payload bytes of those in flight past which no more are sent, as Mosquitto's max_inflight_bytes: "
        "one message always goes when none is in flight, and the last let in may pass the bound "
        "(default: 0, no bound)",
        group=_QUEUES,
    ),
    Setting(
        "--max-queued",
        count("messages", least=0),
        1000,
        "QoS 1 and 2 messages queued per client behind those in flight, and while a persistent "
        "session's client is away; beyond it new ones are dropped and counted (default: 1000)",
        group=_QUEUES,
    ),
    Setting(
        "--max-queued-bytes",
        count("bytes", least=0),
        16 * _MIB,
        "bytes queued per client likewise (default: 16 MiB)",
        group=_QUEUES,
    ),
    Setting(
        "--max-subscriber-bytes",
        count("bytes"),
        16 * _MIB,
        "bytes queued for one subscriber's socket; beyond, its QoS 0 messages are dropped and counted, "
        "and a subscriber that stays beyond for --send-timeout or falls behind by twice this is "
        "disconnected (send-overflow) (default: 16 MiB)",
        group=_QUEUES,
    ),
    Setting(
        "--max-outbox-bytes",
        count("bytes"),
        256 * _MIB,
        "bytes queued for all subscribers' sockets in one worker; beyond, QoS 0 messages are dropped "
        "and counted, and the subscriber holding the most is disconnected if it is behind by more than "
        "its own bound (default: 256 MiB)",
        group=_QUEUES,
    ),
    Setting(
        "--session-expiry",
        seconds(least=0),
        86400.0,
        "seconds a 3.1.1 persistent session (CleanSession=0) is kept after its client left, and the most an"
        " MQTT 5 client's Session Expiry Interval is granted (default: 86400)",
        group=_QUEUES,
    ),
    Setting(
        "--max-retained-bytes",
        count("bytes", least=0),
        512 * _MIB,
        "bytes of retained topics and payloads kept (presence not included); beyond, new ones are "
        "refused and counted (default: 512 MiB)",
        group=_QUEUES,
    ),
    Setting(
        "--retain-available",
        Choice(("true", "false")),
        "true",
        "false: clients may not publish retained messages, as Mosquitto's retain_available false: an MQTT 5 "
        "CONNACK says Retain Available 0, a PUBLISH with RETAIN 1 ends the connection (5.0: DISCONNECT 0x9A) "
        "and a retained Will refuses the CONNECT (5.0: CONNACK 0x9A); presence stays retained unless "
        "--no-retain-presence (default: true)",
        group=_QUEUES,
    ),
    Setting(
        "--message-size-limit",
        count("bytes", least=0, most=MAX_REMAINING_LENGTH),
        0,
        "longest payload a client's PUBLISH or Will may carry, as Mosquitto's message_size_limit: a longer "
        "PUBLISH is acknowledged (0x97 in MQTT 5), neither routed nor retained, and counted; a longer Will "
        "refuses the CONNECT (5, or 0x95 in 5.0). 0: no limit but --max-packet-size (default: 0)",
        group=_QUEUES,
    ),
    # Durable state.
    Setting(
        "--persistence",
        Text(metavar="FILE"),
        None,
        "keep retained messages, persistent sessions and every device's last presence in this SQLite file "
        "(made if absent), so a restart or a crash loses none of them; devices online when the server "
        "stopped get one offline event at the next start (server-shutdown, or server-lost after a crash). "
        "A file that is not this server's, is corrupt or cannot be written is refused "
        "(default: none, the state lives in memory; a fleet keeps it in Redis)",
        group=_DURABLE,
    ),
    Setting(
        "--persistence-sync",
        Choice(SYNC_MODES),
        "always",
        "always: a PUBACK for a message retained or queued for a session waits for its group's commit "
        "(nothing acknowledged is lost, even to a crash); interval: a commit every "
        "--persistence-interval, PUBACKs do not wait (a crash may lose that much); off: at shutdown "
        "and every --autosave-interval, as Mosquitto's persistence (default: always)",
        group=_DURABLE,
    ),
    Setting(
        "--persistence-interval",
        seconds(),
        0.1,
        "seconds between commits with --persistence-sync interval (default: 0.1)",
        group=_DURABLE,
    ),
    Setting(
        "--autosave-interval",
        seconds(),
        1800.0,
        "seconds between commits with --persistence-sync off, Mosquitto's autosave_interval (default: 1800)",
        group=_DURABLE,
    ),
    # A fleet.
    Setting(
        "--cluster",
        Text(metavar="URL"),
        None,
        "share presence with a fleet of gateways on Redis >= 7: one server, redis://HOST:PORT/DB "
        "(rediss:// for TLS); through Sentinels, following a failover, "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]; or a Redis Cluster, "
        "redis+cluster://HOST:PORT[,HOST:PORT...][/?shards=N]; credentials as USER:PASSWORD@ before the "
        "first HOST (default: this machine only, no external service)",
        group=_FLEET,
    ),
    Setting(
        "--node",
        Text(metavar="NAME"),
        None,
        "this gateway's name in the fleet (default: HOST:PORT); each worker is NODE/wI",
        group=_FLEET,
    ),
    Setting(
        "--lease",
        seconds(least=2.0),
        10.0,
        "seconds a fleet node's lease lives without renewal (renewed every second, so at least 2); a "
        "gateway that dies is declared lost this long after (default: 10; shorter finds dead gateways "
        "sooner, but a gateway too busy to renew in time is declared lost while alive)",
        group=_FLEET,
    ),
    # The engine.
    Setting(
        "--engine",
        Choice(ENGINES),
        "dense",
        "dense: one task serves every connection (the default, ~1 KiB per device); "
        "streams: a trio task per connection (default: dense)",
        group=_ENGINE,
    ),
    Setting(
        "--coalesce",
        seconds(least=0),
        0.0,
        "dense engine: while packets keep coming, serve them in one pass every this many seconds "
        "instead of one wake-up each (less CPU per heartbeat, replies up to that much later; default: 0)",
        group=_ENGINE,
    ),
    Setting(
        "--coalesce-pings",
        seconds(least=0),
        DEFAULT_COALESCE_PINGS,
        "dense engine: while nothing but PINGREQs comes, and faster than one in this many seconds, "
        "serve them in one pass every this many seconds (a fleet's heartbeats cost a wake-up a window; "
        "a lone PINGREQ is answered at once; a packet that arrives during a window waits up to that "
        "long; any other traffic is served at once; 0: never; default: 0.04)",
        group=_ENGINE,
    ),
    Setting(
        "--trio-waits",
        Flag(),
        False,
        "dense engine: always wait for the sockets through trio's loop, never on the engine's own "
        "epoll set while trio is idle (more CPU a wake-up; for comparison; see idlekeeper.open_engine)",
        group=_ENGINE,
    ),
    Setting(
        "--gc-freeze",
        seconds(least=0),
        2.0,
        "seconds between freezing long-lived objects out of the garbage collector's scans; 0: never (default: 2)",
        group=_ENGINE,
    ),
    # Set by the supervisor for its workers.
    Setting("--bus", Text(), None, "", hidden=True),
    Setting("--bus-buffer", count("bytes"), 64 * _MIB, "", hidden=True),
)
"""The heartbeat server's options, in the order --help lists them."""
