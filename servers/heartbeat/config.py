"""A heartbeat worker's configuration: every setting, its default and its checks."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..config import WorkerConfig
from .bridge import BridgeSpec
from .broker.budget import DEFAULT_MAX_OUTBOX_BYTES, DEFAULT_MAX_SUBSCRIBER_BYTES
from .broker.outbox import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_WINDOW
from .broker.persistent import DEFAULT_EXPIRY, DEFAULT_MAX_SESSIONS
from .broker.retained import DEFAULT_MAX_BYTES, DEFAULT_MAX_OWNER_BYTES, DEFAULT_MAX_OWNER_COUNT
from .coordination.registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .listener import ListenerConfig
from .mqtt.policy import (
    DEFAULT_MAX_CLIENT_ID,
    DEFAULT_MAX_QOS,
    DEFAULT_MAX_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_MAX_USERNAME,
    DEFAULT_PRESENCE_PREFIX,
    check_presence_prefix,
)
from .presence.event import PresenceSink
from .security.acl import AclFile
from .security.connect_rate import DEFAULT_CONNECT_RATE
from .security.passwords import PasswordFile
from .security.throttle import ThrottlePolicy

DEFAULT_COALESCE_PINGS = 0.04
"""Seconds PINGREQs are gathered (the dense engine's window while a fleet pings faster
than one a window): MQTT asks a PINGRESP "within a reasonable amount of time", and
clients wait seconds."""

__all__ = ["DEFAULT_COALESCE_PINGS", "ENGINES", "KEEPALIVE_OVER_MAX", "HeartbeatConfig"]

logger = logging.getLogger("servers.heartbeat")

ENGINES = ("dense", "streams")
KEEPALIVE_OVER_MAX = ("cap", "honour", "refuse")
"""The choices of :attr:`HeartbeatConfig.keepalive_over_max`."""
"""How connections are served: see :mod:`.transports.dense` and :mod:`.transports.streams`."""


@dataclass
class HeartbeatConfig(WorkerConfig):
    """Everything a heartbeat worker needs to know. The CLI fills it in."""

    port: int = 1883
    connect_timeout: float = 10.0
    max_idle: float | None = 3600.0
    max_keepalive: int = 3600
    keepalive_over_max: str = "cap"
    """What a 3.1.1 or 3.1 client asking more than ``max_keepalive`` gets, since it cannot
    be told (5.0 clients are told, Server Keep Alive): ``cap`` (held to 1.5 x the
    maximum), ``honour`` (its own), ``refuse`` (CONNACK 2, as Mosquitto 2.0.12+)."""
    send_timeout: float = 30.0
    max_packet_size: int = 256 * 1024
    max_connections: int = 18_000
    presence_prefix: str = DEFAULT_PRESENCE_PREFIX
    """Topic prefix of presence events (``$SYS/presence/``); devices' own publishes under it
    are dropped. Checked by :func:`~.mqtt.policy.check_presence_prefix`."""
    max_qos: int = DEFAULT_MAX_QOS
    """Highest QoS granted to subscribers and routed for publishers: 0, 1 or 2."""
    max_client_id: int = DEFAULT_MAX_CLIENT_ID
    """Bytes of UTF-8 a client id may have; longer, CONNACK 2 (see :mod:`.mqtt.policy`)."""
    max_username: int = DEFAULT_MAX_USERNAME
    """Bytes of UTF-8 a username may have; longer, CONNACK 4."""
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    """Topic filters one client may hold; past it, 0x80 in SUBACK."""
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    """Bytes of filter text one client may hold; past it, 0x80 in SUBACK."""
    max_inflight: int = DEFAULT_WINDOW
    """QoS 1 and 2 messages sent to a client and not yet acknowledged, at most; also the
    Receive Maximum an MQTT 5 CONNACK announces (a 5.0 client's own may lower the first)."""
    max_inflight_bytes: int = 0
    """Payload bytes in flight to a client past which no more go, as Mosquitto's
    ``max_inflight_bytes`` (one message always goes when none is in flight); 0: no bound."""
    max_topic_alias: int = 10
    outbound_topic_aliases: bool = True
    """Topic aliases an MQTT 5 client may set towards the server (its Topic Alias Maximum); 0: none."""
    max_queued: int = DEFAULT_MAX_QUEUED
    """QoS 1 and 2 messages queued per client behind those in flight (while it is away, too)."""
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    """Bytes queued per client behind those in flight."""
    max_subscriber_bytes: int = DEFAULT_MAX_SUBSCRIBER_BYTES
    """Bytes queued for one subscriber's socket; beyond, its QoS 0 messages are dropped (see :mod:`.broker.budget`)."""
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES
    """Bytes queued for all subscribers' sockets in this worker; beyond, QoS 0 messages are dropped."""
    session_expiry: float = DEFAULT_EXPIRY
    """Seconds a persistent session (CleanSession=0) is kept after its client left."""
    max_persistent_sessions: int = DEFAULT_MAX_SESSIONS
    """Persistent sessions kept at once; past it, a new one is refused (CONNACK 3), a stored one resumes."""
    retain_presence: bool = True
    """Presence events are retained: a new subscription to ``$SYS/presence/#`` first gets every device's last one."""
    presence_offline_ttl: float | None = 7 * 24 * 3600.0
    """Seconds an offline device's presence stays retained (None: as long as its record is kept)."""
    sys_interval: float = 10.0
    """Seconds between updates of ``$SYS/broker/...`` (Mosquitto's statistics, see
    :mod:`.server.sys_tree`); 0: none are published."""
    max_retained_bytes: int = DEFAULT_MAX_BYTES
    """Bytes of retained topics and payloads kept, presence not included; beyond, new ones are refused."""
    retain_available: bool = True
    """Whether clients may publish retained messages and Wills (Mosquitto's ``retain_available``);
    off, RETAIN 1 is refused as Mosquitto refuses it (see :mod:`.mqtt.policy`). Presence is not a
    client's: ``retain_presence`` governs it."""
    message_size_limit: int = 0
    """The longest payload a client's PUBLISH or Will may carry (Mosquitto's ``message_size_limit``);
    a longer PUBLISH is acknowledged and dropped, a longer Will refuses the CONNECT. 0: no limit."""
    persistence: str | None = None
    """The SQLite file the state is kept in durably (None: in memory only); see :mod:`.coordination.durable`."""
    persistence_sync: str = "always"
    """``always``, ``interval`` or ``off`` (:data:`.coordination.durable.SYNC_MODES`)."""
    persistence_interval: float = 0.1
    """Seconds between commits with ``persistence_sync="interval"``."""
    autosave_interval: float = 1800.0
    """Seconds between commits with ``persistence_sync="off"``."""
    persistence_check: bool = True
    """Read the whole file through (``PRAGMA quick_check``) when it is opened; the command
    line has done so before it starts anything, and turns it off."""
    max_retained_per_client: int = DEFAULT_MAX_OWNER_COUNT
    """Retained messages one client (the one that last set each) may hold; beyond, refused (the old one stays)."""
    max_retained_bytes_per_client: int = DEFAULT_MAX_OWNER_BYTES
    """Bytes of retained topics and payloads one client may hold; beyond, refused (the old one stays)."""
    engine: str = "dense"
    """``dense`` (one task serves every connection) or ``streams`` (a task per connection)."""
    coalesce: float = 0.0
    """Dense engine: seconds packets are gathered per pass while they keep coming (CPU for latency)."""
    coalesce_pings: float = DEFAULT_COALESCE_PINGS
    """Dense engine: seconds PINGREQs are gathered per pass while nothing else comes and they
    come faster than one such window each (CPU for the latency of a packet arriving
    meanwhile; 0: never); see :func:`idlekeeper.open_engine`'s ``coalesce_canned`` and
    ``canned_rate``."""
    direct_wait: bool = True
    """Dense engine: while trio has nothing else to do, wait for the sockets on the engine's own
    epoll set (``--trio-waits`` turns it off); see :func:`idlekeeper.open_engine`'s ``direct_wait``."""
    max_connect_rate: float = DEFAULT_CONNECT_RATE
    """CONNECTs a second from one source address, after a burst of a minute's worth; past
    it, CONNACK 3 (see :mod:`.security.connect_rate`). 0: unbounded."""
    max_device_records: int = 1_000_000
    """Presence records kept for /devices; past it, offline ones are forgotten, ids seen once first."""
    max_device_record_bytes: int = DEFAULT_RECORD_BYTES
    """Bytes of presence records kept (each ~384 B plus its client id); past it, likewise."""
    auth: PasswordFile | None = None
    auth_throttle: ThrottlePolicy | None = field(default_factory=ThrottlePolicy)
    """How failed password checks are throttled per source address and per username
    (see :mod:`.security.throttle`); None: not at all."""
    auth_threads: int = 1
    """Password checks hashed at once, each in a worker thread (the event loop never hashes)."""
    acl: AclFile | None = None
    """Who may subscribe to and publish on what (Mosquitto's ``acl_file`` format); None: anyone."""
    node: str = ""
    """This gateway's name in a fleet (empty on a lone machine); part of every session's epoch."""
    extra_sinks: list[PresenceSink] = field(default_factory=list)
    """Presence sinks of the default (in-process) coordinator; other coordinators hold their own."""
    listeners: list[ListenerConfig] | None = None
    bridges: list[BridgeSpec] = field(default_factory=list)
    """Bridges to other brokers (``--bridge``, a configuration file's ``connection``
    sections), run by worker 0 only: one bridge per box, not one per worker."""
    """The listeners served (``--listener``, a configuration file's sections); None: one
    on ``host:port`` (TLS with ``tls``), and one for WebSockets on ``ws_port`` if set."""
    allow_anonymous: bool | None = None
    """Whether a client without a username is let in; None: yes without a password file,
    no with one. A listener's own (``per_listener_settings``) overrides it."""
    allow_zero_length_clientid: bool = True
    """Whether a client may connect with an empty client id (and be given one)."""
    ws_port: int | None = None
    """A port for MQTT over WebSockets (browsers' only way in), beside the TCP one; None: none."""
    ws_path: str = "/mqtt"
    """The request path the WebSocket listener serves."""
    ws_allowed_origins: frozenset[str] | None = None
    """Browser origins let in (``https://dash.example.com``); None: any. See :mod:`..ws.handshake`."""

    def __post_init__(self) -> None:
        check_presence_prefix(self.presence_prefix)
        if self.max_qos not in (0, 1, 2):
            raise ValueError(f"max_qos must be 0, 1 or 2, not {self.max_qos}")
        if not 1 <= self.max_inflight <= 65535:
            raise ValueError(f"max_inflight must be 1 to 65535 (an MQTT 5 Receive Maximum), not {self.max_inflight}")
        if self.max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be 0 (no bound) or more, not {self.max_inflight_bytes}")
        if not 0 <= self.max_topic_alias <= 65535:
            raise ValueError(f"max_topic_alias must be 0 to 65535, not {self.max_topic_alias}")
        if self.keepalive_over_max not in KEEPALIVE_OVER_MAX:
            raise ValueError(f"keepalive_over_max must be one of {', '.join(KEEPALIVE_OVER_MAX)}")
        if not 1 <= self.max_keepalive <= 65535:
            raise ValueError(f"max_keepalive must be 1 to 65535 seconds, not {self.max_keepalive}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.auth_threads < 1:
            raise ValueError(f"auth_threads must be at least 1, not {self.auth_threads}")
        if self.message_size_limit < 0:
            raise ValueError(f"message_size_limit must be 0 (no limit) or more, not {self.message_size_limit}")
        if self.max_subscriber_bytes < 1 or self.max_outbox_bytes < 1:
            raise ValueError("max_subscriber_bytes and max_outbox_bytes must be at least 1")
        for name in ("max_client_id", "max_username", "max_subscriptions", "max_subscription_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
