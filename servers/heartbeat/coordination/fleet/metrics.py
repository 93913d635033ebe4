"""What a fleet node counts, the fleet-wide figures it reads, and both as Prometheus families."""

from __future__ import annotations

import trio

from ....prometheus import Families, Metric
from .keys import FleetKeys
from .link import RedisLink

__all__ = ["STATS_EVERY", "FleetCounts", "fleet_families", "read_fleet_figures"]

STATS_EVERY = 5.0
"""Seconds between reads of the fleet-wide session and retained figures (for /metrics)."""


class FleetCounts:
    """What this node did (counters, which add up over the fleet), and what the fleet
    keeps as this node last read it (the same on every node).

    The coordinator is one (its figures are its attributes); its parts count into it.
    """

    def __init__(self) -> None:
        self.claims = 0
        self.takeovers = 0
        self.offlines = 0
        self.node_lost = 0
        self.dropped = 0
        self.failed = 0
        """Reports dropped because Redis's script failed on them (a fault, logged)."""
        self.routed = 0
        self.route_skipped = 0
        self.resyncs = 0
        self.repeated_ends = 0
        """Session ends read a second time and passed over (a failover's gap, see :mod:`.reader`)."""
        self.repeated_onlines = 0
        """Session starts (online events) read a second time and passed over, likewise."""
        self.reclaimed_onlines = 0
        """Online events a re-claim wrote (the store had lost the session: a failover, an
        empty restart) that this reader did not remember, and delivered (see :mod:`.reader`)."""
        self.fenced = 0
        """Connections closed at a resynchronisation because the fleet had ended their
        session meanwhile (this node was declared lost while cut off from Redis)."""
        self.server_changes = 0
        """Renewals that found Redis to be another server than at the one before (a
        Sentinel failover, a restart): each resynchronises and reconciles."""
        self.delivered = 0
        self.persistent_routed = 0
        self.persistent_dropped = 0
        self.persistent_expired = 0
        self.persistent_refused = 0
        self.persistent_detached = 0
        self.retained_refused = 0
        self.opens_refused = 0
        self.renew_gap_max = 0.0
        """The longest time between two lease renewals, in seconds."""
        self.fleet_figures = (0, 0, 0, 0, 0)
        """Fleet-wide, read every ``STATS_EVERY`` seconds: sessions, queued bytes, retained
        count and bytes, messages that went with expired sessions."""


async def read_fleet_figures(link: RedisLink, keys: FleetKeys) -> tuple[int, int, int, int, int]:
    """The fleet's persistent sessions, their queued bytes, its retained messages and
    their bytes, and the messages that went with expired sessions."""
    redis = link.redis()
    async with redis.pipeline(transaction=False) as pipe:
        requests = [
            pipe.zcard(keys.psessions),
            pipe.hget(keys.pstats, "queued_bytes"),
            pipe.hlen(keys.retained),
            pipe.hget(keys.retained_stats, "bytes"),
            pipe.hget(keys.pstats, "expired_messages"),
        ]
    with trio.fail_after(link.timeout):
        sessions, queued, retained, retained_bytes, expired_messages = [await r for r in requests]
    figures = (sessions, queued, retained, retained_bytes, expired_messages)
    return tuple(int(v or 0) for v in figures)  # type: ignore[return-value]


def fleet_families(
    counts: FleetCounts, link: RedisLink, *, queued: int, members: int, persistent_filters: int
) -> list[Metric]:
    """Claims, takeovers, node-lost events, the queue, drops, Redis round trips, connection;
    persistent sessions and retained messages."""
    f = Families({})
    f.counter("heartbeat_fleet_claims_total", "Online claims this node applied.", counts.claims)
    f.counter("heartbeat_fleet_takeovers_total", "Claims that displaced a session held anywhere.", counts.takeovers)
    f.counter("heartbeat_fleet_offline_total", "Offline reports this node published.", counts.offlines)
    f.counter("heartbeat_fleet_node_lost_total", "Sessions this node declared lost (node-lost).", counts.node_lost)
    f.gauge("heartbeat_fleet_queued", "Reports waiting for Redis.", queued)
    f.counter("heartbeat_fleet_dropped_total", "Reports dropped: the queue was full.", counts.dropped)
    f.counter(
        "heartbeat_fleet_failed_total",
        "Reports dropped because Redis's script failed on them (each logged): rather than retried for ever.",
        counts.failed,
    )
    f.counter("heartbeat_fleet_routed_total", "Messages routed to other nodes.", counts.routed)
    f.counter("heartbeat_fleet_route_skipped_total", "Messages no other node subscribes to.", counts.route_skipped)
    f.counter("heartbeat_fleet_resyncs_total", "Re-registrations after the lease was lost.", counts.resyncs)
    f.counter(
        "heartbeat_fleet_repeated_ends_total",
        "Session ends read a second time (re-written after a failover) and passed over.",
        counts.repeated_ends,
    )
    f.counter(
        "heartbeat_fleet_repeated_onlines_total",
        "Online events read a second time (re-claimed after a failover lost them) and passed over.",
        counts.repeated_onlines,
    )
    f.counter(
        "heartbeat_fleet_reclaimed_onlines_total",
        "Online events re-written by a re-claim (the store had lost the session) that this node did not "
        "remember reading, delivered.",
        counts.reclaimed_onlines,
    )
    f.counter(
        "heartbeat_fleet_fenced_total",
        "Connections closed on re-registering: the fleet ended their session while this node was cut off.",
        counts.fenced,
    )
    f.counter(
        "heartbeat_fleet_redis_server_changes_total",
        "Times Redis was found to be another server (a failover, a restart): each resynchronises.",
        counts.server_changes,
    )
    f.counter("heartbeat_fleet_delivered_total", "Presence events read from the stream.", counts.delivered)
    f.gauge("heartbeat_fleet_redis_rtt_seconds", "Round trip of the last Redis call.", link.rtt_last)
    f.gauge("heartbeat_fleet_redis_rtt_avg_seconds", "Moving average of Redis round trips.", link.rtt_avg)
    f.gauge("heartbeat_fleet_connected", "1 while Redis answers.", 1 if link.connected else 0)
    f.gauge(
        "heartbeat_fleet_lease_gap_max_seconds",
        "Longest time between two lease renewals: near the lease, the node risks being declared lost alive.",
        counts.renew_gap_max,
    )
    f.gauge("heartbeat_fleet_members", "Nodes whose filters this node knows.", members)
    # Gauges of what the fleet keeps (the same on every node, read every few seconds);
    # counters of what this node did, which add up over the fleet.
    sessions, queued_bytes, retained, retained_bytes, expired_messages = counts.fleet_figures
    f.gauge("heartbeat_persistent_sessions", "Persistent sessions kept fleet-wide (CleanSession=0).", sessions)
    f.gauge("heartbeat_persistent_queued_bytes", "Bytes queued for persistent sessions, fleet-wide.", queued_bytes)
    f.gauge(
        "heartbeat_fleet_persistent_expired_messages",
        "Messages that went with expired persistent sessions, fleet-wide since Redis's data began.",
        expired_messages,
    )
    f.counter(
        "heartbeat_persistent_dropped_total",
        "Messages this node's publishes dropped for a full persistent session queue or the total bound.",
        counts.persistent_dropped,
    )
    f.counter(
        "heartbeat_persistent_expired_total",
        "Persistent sessions this node expired after their client stayed away.",
        counts.persistent_expired,
    )
    f.counter(
        "heartbeat_persistent_refused_total",
        "New persistent sessions refused for this node's clients: the fleet held --max-persistent-sessions.",
        counts.persistent_refused,
    )
    f.counter(
        "heartbeat_persistent_routed_total",
        "QoS 1 and 2 copies this node's publishes gave persistent sessions (sent or queued).",
        counts.persistent_routed,
    )
    f.counter(
        "heartbeat_persistent_detached_total",
        "Persistent sessions this node detached because the node holding them was lost or left.",
        counts.persistent_detached,
    )
    f.counter(
        "heartbeat_persistent_open_refused_total",
        "CONNECTs with CleanSession=0 refused (3): Redis did not answer in time.",
        counts.opens_refused,
    )
    f.gauge("heartbeat_fleet_persistent_filters", "Persistent sessions' filters this node knows.", persistent_filters)
    f.gauge("heartbeat_retained_messages", "Retained messages kept fleet-wide (presence not included).", retained)
    f.gauge("heartbeat_retained_bytes", "Bytes of retained topics and payloads, fleet-wide.", retained_bytes)
    f.counter(
        "heartbeat_retained_refused_total",
        "Retained messages of this node refused by the bound on retained bytes.",
        counts.retained_refused,
    )
    return f.families
