"""Messages between gateways: a device's publish copied into the route stream of every
other node whose subscribers' filters match it, and (QoS 1 and 2) to the persistent
sessions whose filters match it, through the session script.

A routed message is one stream entry (``m``, :func:`encode_route`'s bytes); the node
it is for reads it back with the presence stream (:mod:`.reader`). Under an ACL
(``may_read``), routing to persistent sessions takes two steps: Redis says who the
sessions are, this node decides who may read the topic, then Redis routes to those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .filters import Filters
from .keys import ROUTE_MAXLEN, ROUTE_TTL_MS, FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import Queued, Request
from .sessions import PersistentSessions, username_of
from .values import text

__all__ = ["Routes", "decode_route", "encode_route"]


def encode_route(topic: str, payload: bytes, qos: int) -> bytes:
    """A routed message as its stream entry carries it."""
    # MQTT topics cannot hold U+0000, so it can separate the header from the body.
    return b"%d\x00%s\x00" % (qos, topic.encode()) + payload


def decode_route(data: bytes) -> tuple[str, bytes, int]:
    """The topic, payload and QoS of :func:`encode_route`'s bytes; ValueError if malformed."""
    qos, topic, payload = data.split(b"\x00", 2)
    return topic.decode(), payload, int(qos)


class Routes:
    """The script calls that route a publish, by the filters this node knows."""

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        counts: FleetCounts,
        filters: Filters,
        sessions: PersistentSessions,
        *,
        node: str,
        may_read: Callable[[str | None, str, str], bool] | None,
    ) -> None:
        self.link = link
        self.scripts = link.scripts
        self.counts = counts
        self.route_prefix = keys.route_prefix
        self.remote = filters.remote
        self.persistent = filters.persistent
        self.sessions = sessions
        self.node = node
        self.may_read = may_read

    def requests(self, report: Queued, client: Any) -> list[Request]:
        """The calls that route ``report`` (a "route" report) on ``client`` (a connection or
        a pipeline), each with what to do with its reply; none if nobody wants it now."""
        out: list[Request] = []
        targets = [n for n, f in self.remote.items() if n != self.node and f.matches(report.topic)]
        if targets:
            data = encode_route(report.topic, report.payload, report.qos)
            keys = [self.route_prefix + n for n in targets]

            def routed(_: Any) -> None:
                self.counts.routed += len(targets)

            out.append((self.scripts.route(keys, [data, str(ROUTE_MAXLEN), str(ROUTE_TTL_MS)], client=client), routed))
        if report.qos > 0 and self.may_read is None:
            filters = self.persistent.matching(report.topic)
            if filters:
                args: list[str | bytes] = [report.topic, report.payload, str(report.qos), "f", *filters]
                out.append((self.sessions.script("route", args, client), self.sessions.routed))
        return out

    def two_steps(self, report: Queued) -> bool:
        """Whether ``report`` routes to persistent sessions under an ACL: who may read the
        topic is decided here, between asking Redis who the sessions are and routing."""
        return (
            report.kind == "route"
            and report.qos > 0
            and self.may_read is not None
            and bool(self.persistent.matching(report.topic))
        )

    async def route_checked(self, report: Queued) -> None:
        """The second step of a :meth:`two_steps` report: ask, decide, route."""
        may_read = self.may_read
        assert may_read is not None
        filters = self.persistent.matching(report.topic)
        redis, call, script = self.link.redis(), self.link.call, self.sessions.script
        args: list[str | bytes] = [report.topic, report.payload, str(report.qos), "q", *filters]
        found = await call(script("route", args, redis))
        allowed: list[str | bytes] = []
        for i in range(0, len(found), 3):
            client_id = text(found[i])
            if may_read(username_of(found[i + 2]), client_id, report.topic):
                allowed += [client_id, str(int(found[i + 1]))]
        if allowed:
            args = [report.topic, report.payload, str(report.qos), "t", *allowed]
            self.sessions.routed(await call(script("route", args, redis)))
