"""The fleet's Lua scripts: read once from ``lua/`` and registered with each connection.

The registry's rules (:mod:`..registry`) and every change to a persistent session or
a retained message are applied by these scripts, so each decision and the presence
events it emits are one atomic step on the server, whichever node asks and however
often it retries. coredis runs a registered script by EVALSHA and loads it again
when Redis answers NOSCRIPT (after a restart); the files are read as they are,
byte for byte, so their SHA-1 is that of the text Redis caches.

Every script names the device keys it derives from its arguments through the
prefix (ARGV). On Redis Cluster every key a script touches is in the slot of the
keys it is given (:mod:`.shards`): a shard's for presence, the hub's for the rest,
so each script call is given at least one key, which routes it.

``persistent_session.lua`` does every session operation (ARGV[3] names it) so that
its helpers exist once. ARGV: prefix, node, op, window (its messages, then ``/`` and its
payload bytes if they are bounded: ``20/4096``), max queued, max queued
bytes, total queued bytes, expiry (ms), route stream maxlen, route stream ttl (ms),
notices maxlen, then the operation's own arguments from ARGV[12] on.

``retain_message.lua`` keeps ``retained`` (topic -> head and payload),
``retained-index`` (the topics, all scores 0, for ZRANGEBYLEX), ``retained-expiry``
(those with an MQTT 5 Message Expiry, by when) and ``retained-stats`` (bytes, refused),
and each message's owner (the client that set it last) with the count and bytes each
owner holds. ARGV: prefix, topic, payload, head, max bytes, max count, owner, owner's
max count, owner's max bytes, expires at (ms, or empty), now (ms); 1 kept (or
cleared), 0 refused. As the retained store: a replacement no larger always fits, one
that does not fit first frees expired messages, and a refused one leaves the topic's
old message in place (one client filling the store must not erase another's).
"""

from __future__ import annotations

from importlib import resources

import coredis
from coredis.commands import Script

__all__ = ["FleetScripts"]


def _read(name: str) -> str:
    return (resources.files(__name__.rpartition(".")[0]) / "lua" / name).read_text(encoding="utf-8")


_CLAIM = _read("claim_session.lua")
_LIFE = _read("record_life.lua")  # how long an offline record lives, for the two below
_OFFLINE = _LIFE + _read("end_session.lua")
_LOSE = _LIFE + _read("end_lost_sessions.lua")
_FINISH = _read("finish_sweep.lua")
_KEEP_LOCK = _read("keep_lock.lua")
_RENEW = _read("renew_lease.lua")
_LAPSED = _read("lapsed_members.lua")
_ROUTE = _read("route_message.lua")
_SESSION = _read("persistent_session.lua")
_RETAIN = _read("retain_message.lua")


class FleetScripts:
    """The scripts as registered with the node's current connection (by :meth:`register`)."""

    claim: Script[bytes]
    """A session comes online: the device's record, its takeover, the presence events."""
    offline: Script[bytes]
    """A session ended (compare-and-set on its epoch), or its record is forgotten."""
    lose: Script[bytes]
    """A batch of a node's sessions ended at once (node lost, shutdown, dropped reports)."""
    finish: Script[bytes]
    """A swept node's keys and membership go, once it holds nothing and its lease is gone."""
    keep_lock: Script[bytes]
    """A sweep lock kept a while longer by its holder; 0 once another holds it."""
    renew: Script[bytes]
    """This node's lease kept (1) or taken afresh (0), and its membership."""
    lapsed: Script[bytes]
    """The members whose lease is gone."""
    route: Script[bytes]
    """A message appended to the route streams of the nodes whose subscribers want it."""
    session: Script[bytes]
    """Every operation on a persistent session."""
    retain: Script[bytes]
    """A retained message kept within the bounds, or cleared."""

    def register(self, redis: coredis.Redis[bytes] | coredis.RedisCluster[bytes]) -> None:
        """Bind every script to ``redis`` (a new connection)."""
        self.claim = redis.register_script(_CLAIM)
        self.offline = redis.register_script(_OFFLINE)
        self.lose = redis.register_script(_LOSE)
        self.finish = redis.register_script(_FINISH)
        self.keep_lock = redis.register_script(_KEEP_LOCK)
        self.renew = redis.register_script(_RENEW)
        self.lapsed = redis.register_script(_LAPSED)
        self.route = redis.register_script(_ROUTE)
        self.session = redis.register_script(_SESSION)
        self.retain = redis.register_script(_RETAIN)
