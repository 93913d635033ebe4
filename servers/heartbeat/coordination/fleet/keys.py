"""The names of the fleet's keys in Redis (≥ 7) and the bounds of its streams.

Every key is under one ``prefix`` (default ``idlekeeper:``)::

    members               set: every node id that registered
    node:<node>           the node's lease (a string with a TTL of ``lease`` s)
    owned:<node>          set: client ids whose online session the node holds
    dev:<client-id>       hash: the device's record (status, epoch, node, worker,
                          peer, time, reason, keep_alive, owner, event = its JSON)
    presence              stream: every presence event, in order (MAXLEN ~ stream_maxlen)
    filters               hash: node -> JSON list of its subscribers' topic filters
    sweep:<node>          the lock of whoever declares a dead node's devices lost
    route:<node>          stream: device messages for that node's subscribers
                          (bounded, expires when idle; deleted with a dead node)
    filters-changed       stream: ids of nodes whose filters just changed

Persistent sessions (CleanSession=0), by client id (see :mod:`.sessions`)::

    ps:<client-id>        hash: holder (the epoch holding its connection, '' while
                          away), hnode (the holder's node), was (the last holder),
                          left (ms, Redis's clock), user, lastid (the last packet id
                          given), seq (send order), qb (bytes queued), dropping,
                          v5 ('1': the client last spoke MQTT 5.0; packets are written so),
                          exp (ms the session outlives its connection: its client's
                          Session Expiry; absent: the fleet's --session-expiry),
                          reopened ('1': resumed by a newer connection whose attach
                          has not come; the older one's detach leaves the expiry)
    psub:<client-id>      hash: topic filter -> granted QoS
    psubo:<client-id>     hash: topic filter -> its MQTT 5 options, packed (only those
                          that have any: No Local, Retain As Published, identifier)
    pin:<client-id>       set: QoS 2 packet ids received whose PUBREL has not come
    pfl:<client-id>       hash: packet id -> a message in flight (msgpack: seq, qos,
                          retain, stage, topic, payload, MQTT 5 properties, born ms)
    pq:<client-id>        list: the messages queued behind the window (msgpack: qos,
                          retain, topic, payload, MQTT 5 properties, born ms)
    psessions             sorted set: client id -> when it expires (ms; +inf while held)
    pheld:<node>          set: client ids whose connection the node holds
    pf:<filter>           hash: client id -> QoS, every persistent session subscribed to it
    pfilters              hash: topic filter -> how many persistent sessions hold it
    pfilters-version      counter: the number of the last ``pfilters-changed`` notice
    pfilters-changed      stream: a filter gained its first session or lost its last
                          (f filter, on 1/0, v number)
    pstats                hash: queued_bytes (over every session), dropped, expired,
                          expired_messages (held by sessions when they expired)

Retained messages (see :mod:`.retained`)::

    retained              hash: topic -> a head (the QoS digit, or with MQTT 5
                          properties and an expiry, see :mod:`.retained`) and the payload
    retained-index        sorted set: every retained topic (score 0, paged by ZRANGEBYLEX)
    retained-expiry       sorted set: the retained topics whose message expires (score:
                          when, in ms of the wall clock)
    retained-stats        hash: bytes (topics and payloads), refused
    retained-owner        hash: topic -> the client whose message it is (its share)
    retained-shares       hash: client -> messages it holds; client + NUL -> their bytes

The Lua scripts (:mod:`.scripts`) derive the per-client keys from the prefix
themselves, so only the names Python uses are here.

On Redis Cluster (:mod:`.shards`) the names above are the same with a hash tag after
the prefix: ``dev:``, ``presence`` and ``owned:`` (and a copy of each lease,
``node:<node>``, that a sweep checks in the same step) under each shard's tag,
``idlekeeper:{s3}presence``; everything else under the hub's, ``idlekeeper:{h}members``.
"""

from __future__ import annotations

from typing import Any

import coredis

from .shards import shard_index, spread_tags

__all__ = ["NOTICE_MAXLEN", "ROUTE_MAXLEN", "ROUTE_TTL_MS", "TRIM_NOTICES", "TRIM_ROUTES", "FleetKeys", "ShardKeys"]

ROUTE_MAXLEN = 10_000
"""Messages kept in a node's route stream: a node that falls this far behind loses the oldest."""
ROUTE_TTL_MS = 60_000
"""A route stream nobody writes to for this long goes (its node is gone or has no remote senders)."""
NOTICE_MAXLEN = 100_000
"""Notices kept in ``pfilters-changed``: a node further behind reloads the whole set."""
TRIM_NOTICES: dict[str, Any] = {
    "trim_strategy": coredis.PureToken.MAXLEN,
    "threshold": 1000,
    "trim_operator": coredis.PureToken.APPROXIMATELY,
}
"""How XADD trims ``filters-changed`` (to about its last 1,000 notices)."""
TRIM_ROUTES: dict[str, Any] = {**TRIM_NOTICES, "threshold": ROUTE_MAXLEN}
"""How XADD trims a route stream: to ``ROUTE_MAXLEN``, as the scripts do."""


class ShardKeys:
    """The presence keys of one shard: device records, the presence stream, the sets of
    devices each node holds, and a copy of each node's lease (see :mod:`.shards`)."""

    __slots__ = ("index", "prefix", "dev_prefix", "stream", "owned_prefix", "lease_prefix", "owned", "lease")

    def __init__(self, index: int, prefix: str, node: str) -> None:
        self.index = index
        self.prefix = prefix
        """What the scripts derive this shard's keys from."""
        self.dev_prefix = prefix + "dev:"
        self.stream = prefix + "presence"
        self.owned_prefix = prefix + "owned:"
        self.lease_prefix = prefix + "node:"
        self.owned = self.owned_prefix + node
        self.lease = self.lease_prefix + node


class FleetKeys:
    """The names of the keys one node uses: the fleet's shared ones and its own.

    Keys of another node or of a device are a ``*_prefix`` followed by its id; they
    are built where they are used, often once per report. ``shards`` > 0 lays them out
    for Redis Cluster in that many presence shards; 0 is one Redis's layout.
    """

    __slots__ = (
        "prefix", "members", "filters", "changed", "pfilters", "pfilters_version",
        "pchanged", "psessions", "pstats", "retained", "retained_index", "retained_stats",
        "lease_prefix", "route_prefix", "held_prefix", "sweep_prefix", "lease", "routes",
        "held", "shards", "sharded",
    )  # fmt: skip

    def __init__(self, prefix: str, node: str, shards: int = 0) -> None:
        self.sharded = shards > 0
        if self.sharded:
            tags = spread_tags(shards)
            self.shards = [ShardKeys(k, f"{prefix}{{{tag}}}", node) for k, tag in enumerate(tags[:-1])]
            prefix = f"{prefix}{{{tags[-1]}}}"
        else:
            self.shards = [ShardKeys(0, prefix, node)]
        self.prefix = prefix
        self.members = prefix + "members"
        self.filters = prefix + "filters"
        self.changed = prefix + "filters-changed"
        self.pfilters = prefix + "pfilters"
        self.pfilters_version = prefix + "pfilters-version"
        self.pchanged = prefix + "pfilters-changed"
        self.psessions = prefix + "psessions"
        self.pstats = prefix + "pstats"
        self.retained = prefix + "retained"
        self.retained_index = prefix + "retained-index"
        self.retained_stats = prefix + "retained-stats"
        self.lease_prefix = prefix + "node:"
        self.route_prefix = prefix + "route:"
        self.held_prefix = prefix + "pheld:"
        self.sweep_prefix = prefix + "sweep:"
        # This node's own.
        self.lease = self.lease_prefix + node
        self.routes = self.route_prefix + node
        self.held = self.held_prefix + node

    def shard(self, client_id: str) -> ShardKeys:
        """The shard that holds ``client_id``'s presence."""
        return self.shards[shard_index(client_id, len(self.shards))]

    def by_shard(self, client_ids: list[str]) -> list[tuple[ShardKeys, list[str]]]:
        """``client_ids`` grouped by shard (each group in the order given)."""
        if not self.sharded:
            return [(self.shards[0], client_ids)] if client_ids else []
        groups: dict[int, list[str]] = {}
        for client_id in client_ids:
            groups.setdefault(shard_index(client_id, len(self.shards)), []).append(client_id)
        return [(self.shards[k], ids) for k, ids in sorted(groups.items())]
