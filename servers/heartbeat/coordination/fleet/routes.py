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
from dataclasses import dataclass, replace
from typing import Any

from .filters import Filters
from .keys import ROUTE_MAXLEN, ROUTE_TTL_MS, FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import Queued, Request
from .sessions import PersistentSessions, username_of
from .values import text

__all__ = ["RoutedMessage", "Routes", "decode_route", "encode_route"]


@dataclass(frozen=True, slots=True)
class RoutedMessage:
    """A message as a route entry carries it to a node."""

    topic: str
    payload: bytes
    qos: int
    properties: bytes = b""
    """The MQTT 5 publisher's properties, packed."""
    retain: bool = False
    """The retain flag it was published with (for Retain As Published)."""
    group: str = ""
    """The shared subscription (``$share/...``) the node was picked to serve it to; empty:
    the node's other subscribers only."""


def encode_route(message: RoutedMessage) -> bytes:
    """``message`` as its stream entry carries it: ``<qos>\\0<topic>\\0<payload>``; or,
    with MQTT 5 properties, the retain flag or a shared subscription,
    ``<qos>,<properties' length>,<flags>\\0[<group>\\0]<topic>\\0<properties><payload>``,
    the flags ``r`` (retained) and ``s`` (a group follows). A node that predates the
    longer form drops such an entry as malformed, and logs it."""
    # MQTT topics and filters cannot hold U+0000, so it can separate the fields.
    topic, payload, properties = message.topic.encode(), message.payload, message.properties
    if not properties and not message.retain and not message.group:
        return b"%d\x00%s\x00" % (message.qos, topic) + payload
    flags = (b"r" if message.retain else b"") + (b"s" if message.group else b"")
    group = message.group.encode() + b"\x00" if message.group else b""
    return b"%d,%d,%s\x00%s%s\x00" % (message.qos, len(properties), flags, group, topic) + properties + payload


def decode_route(data: bytes) -> RoutedMessage:
    """The message :func:`encode_route` wrote; ValueError if malformed."""
    head, rest = data.split(b"\x00", 1)
    fields = head.split(b",")
    if len(fields) == 1:
        topic, payload = rest.split(b"\x00", 1)
        return RoutedMessage(topic.decode(), payload, int(head))
    if len(fields) != 3 or fields[2].strip(b"rs"):
        raise ValueError(f"route header {head[:32]!r}")
    group = b""
    if b"s" in fields[2]:
        group, rest = rest.split(b"\x00", 1)
    topic, body = rest.split(b"\x00", 1)
    length = int(fields[1])
    if not 0 <= length <= len(body):
        raise ValueError(f"properties of {length} bytes in a body of {len(body)}")
    return RoutedMessage(
        topic.decode(), body[length:], int(fields[0]), body[:length], b"r" in fields[2], group.decode()
    )


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
        targets = [n for n, f in self.remote.items() if n != self.node and f.matches_plain(report.topic)]
        if not report.plain:
            targets = []
        message = RoutedMessage(report.topic, report.payload, report.qos, report.properties, report.retain)
        if targets:
            out.append(self._append(targets, encode_route(message), client))
        for node, groups in report.shares.items():
            for group in groups:  # the node picked to serve the group's copy
                out.append(self._append([node], encode_route(replace(message, group=group)), client))
        if report.qos > 0 and self.may_read is None and report.plain:
            filters = self.persistent.matching(report.topic)
            if filters:
                args = [*self._message(report), "f", *filters]
                out.append((self.sessions.script("route", args, client), self.sessions.routed))
        return out

    @staticmethod
    def _message(report: Queued) -> list[str | bytes]:
        """The session script's route arguments that say what the message is."""
        retain = "1" if report.retain else "0"
        return [report.topic, report.payload, str(report.qos), report.properties, retain, report.origin]

    def _append(self, nodes: list[str], data: bytes, client: Any) -> Request:
        keys = [self.route_prefix + n for n in nodes]

        def routed(_: Any) -> None:
            self.counts.routed += len(nodes)

        return self.scripts.route(keys, [data, str(ROUTE_MAXLEN), str(ROUTE_TTL_MS)], client=client), routed

    def two_steps(self, report: Queued) -> bool:
        """Whether ``report`` routes to persistent sessions under an ACL: who may read the
        topic is decided here, between asking Redis who the sessions are and routing."""
        return (
            report.kind == "route"
            and report.plain
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
        found = await call(script("route", [*self._message(report), "q", *filters], redis))
        allowed: list[str | bytes] = []
        for i in range(0, len(found), 3):
            client_id = text(found[i])
            if may_read(username_of(found[i + 2]), client_id, report.topic):
                allowed += [client_id, str(int(found[i + 1]))]
        if allowed:
            # The filters too: a 5.0 session's copy is shaped by the options of those it matched.
            args = [*self._message(report), "t", str(len(allowed) // 2), *allowed, *filters]
            self.sessions.routed(await call(script("route", args, redis)))
