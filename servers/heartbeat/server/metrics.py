"""A heartbeat worker's live figures as Prometheus families: presence, delivery and its
losses, ends by reason, counted events, password checks and the dense engine."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Protocol

import trio

import idlekeeper

from ...prometheus import Families, Metric
from ..broker.routing import Broker
from ..config import HeartbeatConfig
from ..coordination import Coordinator
from ..mqtt.endings import Offline
from .authenticator import Authenticator
from .connection import Connection
from .dashboard import Dashboard
from .doors import Door

__all__ = ["COUNTERS", "FigureSource", "worker_figures"]

COUNTERS: Iterable[tuple[str, str]] = (
    ("connections", "Connections accepted."),
    ("packets_in", "MQTT control packets received."),
    ("messages_in", "PUBLISH messages received and routed."),
    ("protocol_errors", "Connections closed for violating MQTT (3.1, 3.1.1 or 5.0)."),
    ("auth_failures", "CONNECTs refused for bad or missing credentials (after a check)."),
    ("auth_reloads", "Password file reloads (SIGHUP)."),
    ("auth_throttled", "CONNECTs refused unchecked: their source address or username failed too often."),
    ("auth_checks", "Passwords hashed (each in a worker thread)."),
    ("auth_cache_hits", "CONNECTs accepted without hashing: credentials verified before."),
    ("auth_abandoned", "Password checks skipped: the client hung up while its check waited its turn."),
    ("refused_capacity", "CONNECTs refused because the worker was at its connection cap."),
    ("refused_connect_rate", "CONNECTs refused (3): their source address connected faster than --max-connect-rate."),
    ("wills_published", "Will messages published for devices that died."),
    ("wills_delayed", "MQTT 5 Wills held back for their Will Delay Interval."),
    ("shared_passed_on", "Unacknowledged messages of a shared subscription's member that left, given to another."),
    ("shared_passed_elsewhere", "Such messages given to a member on another worker or gateway (none was here)."),
    ("shared_unacknowledged_lost", "Unacknowledged shared-subscription messages of a member that left, with no other."),
    ("wills_cancelled", "Delayed Wills dropped: the device connected again in time, here or elsewhere."),
    ("refused_keepalive", "3.1.1 CONNECTs refused (2): keep-alive over --max-keepalive (--keepalive-over-max refuse)."),
    ("refused_wills", "CONNECTs refused (5): a Will on a topic the client may not publish to (presence, $, the ACL)."),
    ("denied_wills", "Wills not published: the ACL, reloaded since the CONNECT, no longer lets the client write."),
    ("denied_publishes", "PUBLISHes dropped: the ACL (or the presence prefix) does not let the client write there."),
    (
        "dropped_too_large",
        "PUBLISHes dropped unrouted: a payload over --message-size-limit (acknowledged, 0x97 in MQTT 5).",
    ),
    ("refused_subscriptions", "Filters refused in SUBACK: the client held --max-subscriptions or its bytes already."),
    ("acl_reloads", "ACL file reloads (SIGHUP)."),
    ("subscribe_settles", "SUBACKs held until every other worker routed by the new subscription."),
    ("subscribe_settle_timeouts", "SUBACKs sent before every other worker confirmed (one stalled or gone)."),
    (
        "durable_unconfirmed",
        "Changes acknowledged (a PUBACK, PUBREC or SUBACK) whose commit to the durable store failed: "
        "0x97 to an MQTT 5 PUBACK, kept in memory and retried for the rest.",
    ),
)
"""The worker's counters exported as ``heartbeat_<name>_total``, with their help."""


class FigureSource(Protocol):
    """What the figures are read from: a heartbeat worker (:class:`~.lifecycle.HeartbeatServer`)."""

    config: HeartbeatConfig
    online: dict[str, Connection]
    connections: dict[Connection, None]
    broker: Broker[Connection]
    counters: collections.Counter[str]
    offline_by_reason: collections.Counter[str]
    authenticator: Authenticator
    engine: idlekeeper.Engine | None
    coordinator: Coordinator
    dashboard: Dashboard
    doors: list[Door]

    def packets_in(self) -> int:
        """MQTT control packets received, those the engine answered itself included."""
        ...


def worker_figures(source: FigureSource) -> list[Metric]:
    """This worker's live presence figures, as Prometheus families (its coordinator's last)."""
    f = Families({"worker": str(source.config.worker)})
    f.gauge("heartbeat_devices_online", "Devices with a live, accepted MQTT connection.", len(source.online))
    f.gauge("heartbeat_connections", "Open client connections, handshaking ones included.", len(source.connections))
    broker = source.broker
    f.counter("heartbeat_messages_out_total", "Messages delivered to subscribers.", broker.delivered)
    f.counter_by(
        "heartbeat_messages_dropped_total",
        "Messages dropped for subscribers, by reason: subscriber-bytes and total-bytes (QoS 0 beyond "
        "--max-subscriber-bytes or --max-outbox-bytes), max-queued (QoS 1/2 beyond the outbox's queue), "
        "too-large (past an MQTT 5 subscriber's Maximum Packet Size), expired (its MQTT 5 Message Expiry "
        "ran out while queued).",
        "reason",
        broker.dropped_by,
    )
    budget = broker.budget
    f.gauge(
        "heartbeat_outbox_bytes",
        "Bytes queued for subscribers' sockets in this worker (at most; exact after a recount).",
        budget.total,
    )
    f.gauge(
        "heartbeat_outbox_bytes_peak",
        "The most bytes queued for subscribers' sockets at once.",
        budget.peak_total,
    )
    f.gauge(
        "heartbeat_subscriber_bytes_peak",
        "The most bytes queued for one subscriber's socket.",
        budget.peak_subscriber,
    )
    f.gauge(
        "heartbeat_subscribers_behind",
        "Subscribers losing messages with over half their bound queued.",
        budget.behind,
    )
    f.counter(
        "heartbeat_denied_deliveries_total",
        "Messages not delivered: the ACL does not let the subscriber read the topic.",
        broker.denied,
    )
    f.counter(
        "heartbeat_retained_already_sent_total",
        "Retained messages not sent to a new subscription: it had been sent them live since.",
        broker.retained_resent_skipped,
    )
    f.counter_by(
        "heartbeat_offline_total",
        "Connections ended, by reason.",
        "reason",
        {reason.value: source.offline_by_reason.get(reason.value, 0) for reason in Offline},
    )
    lateness = source.dashboard.lateness
    f.histogram(
        "heartbeat_detection_lateness_seconds",
        "How far past its deadline (last packet + 1.5 x keep-alive) each keep-alive timeout was declared.",
        lateness.cumulative(),
        lateness.sum,
    )
    for name, help_text in COUNTERS:
        value = source.packets_in() if name == "packets_in" else source.counters.get(name, 0)
        f.counter(f"heartbeat_{name}_total", help_text, value)
    doors = source.doors
    f.gauge_by(
        "heartbeat_listener_devices_online",
        "Devices online, by the listener they came through.",
        "listener",
        {door.name: door.online for door in doors},
    )
    f.counter_by(
        "heartbeat_listener_connections_total",
        "Connections accepted, by listener.",
        "listener",
        {door.name: door.accepted for door in doors},
    )
    f.counter_by(
        "heartbeat_listener_refused_total",
        "CONNECTs refused, by the listener they came through.",
        "listener",
        {door.name: door.refused for door in doors},
    )
    if any(door.auth is not None for door in doors):
        _auth_figures(f, source.authenticator)
    engine = source.engine
    if engine is not None:
        f.counter("heartbeat_engine_passes_total", "Passes of the dense engine's loop.", engine.passes)
        f.counter(
            "heartbeat_engine_direct_passes_total",
            "Passes the dense engine started from its own epoll wait while trio was idle (not --trio-waits).",
            engine.direct_passes,
        )
        f.counter(
            "heartbeat_engine_windows_total",
            "Coalescing windows the dense engine waited out (--coalesce, --coalesce-pings).",
            engine.windows,
        )
        f.counter(
            "heartbeat_engine_canned_replies_total",
            "PINGREQs the dense engine answered itself, without a call into the MQTT code (in packets_in too).",
            engine.canned,
        )
        f.counter(
            "heartbeat_engine_accept_errors_total",
            "Accepts that failed for lack of descriptors or memory (each pauses accepting 0.1 s).",
            engine.accept_errors,
        )
        f.counter(
            "heartbeat_engine_callback_errors_total",
            "Protocol callbacks that raised (each closed its own connection).",
            engine.callback_errors,
        )
    return f.families + source.coordinator.figures()


def _auth_figures(f: Families, authenticator: Authenticator) -> None:
    f.gauge(
        "heartbeat_auth_queue",
        "Password checks waiting for a thread (--auth-threads).",
        authenticator.turns.statistics().tasks_waiting,
    )
    gate = authenticator.gate
    if gate is None:
        return
    now = trio.current_time()
    for kind, throttle in (("source", gate.sources), ("user", gate.users)):
        delayed, longest = throttle.delayed(now)
        f.gauge(f"heartbeat_auth_delayed_{kind}s", f"{kind.capitalize()} keys whose delay runs now.", delayed)
        f.gauge(f"heartbeat_auth_{kind}_delay_seconds", f"The longest delay a {kind} key has left.", longest)
        f.gauge(f"heartbeat_auth_tracked_{kind}s", f"{kind.capitalize()} keys with failures remembered.", len(throttle))
