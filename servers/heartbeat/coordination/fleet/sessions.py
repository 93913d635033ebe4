"""Persistent sessions (CleanSession=0) of a fleet on Redis: the calls of the session
script (``lua/persistent_session.lua``) and what its replies mean.

The semantics are those of :class:`~...broker.persistent.SessionStore` (the lone worker's and
the supervisor's); only the place differs. Every change to a session is one call of
the script, so it is atomic whichever node makes it, and the script writes the
packets a connected client is owed straight into the route stream of the node
holding its connection (``route:<node>``, entries ``c`` client id, ``e`` epoch, ``p``
packets), in the order Redis ran them. Delivering through that stream even when the
holder is the node that made the call keeps one order per session: a reply read on
one connection and a stream entry read on another could otherwise swap two messages.
A message for an absent client waits in its queue within its bounds (drops counted
in ``pstats``).

A session expires ``session_expiry`` after its client left: every node's sweeper
discards those due in ``psessions`` (rather than Redis TTLs, which would leave ``pf:``
and the byte count behind). A node declared lost has its sessions detached by the
sweep (``pheld:<node>``), unacknowledged messages kept for the resend. ``open`` goes
through the node's report queue (so it sees the reports before it applied); after a
resynchronisation a node attaches again the sessions it was declared lost with and
still holds, and one whose session is gone (Redis restarted without its data) is
closed, so that its client learns it from CONNACK (session-present 0) and subscribes
again. A batch whose reply was lost is applied again: every session change is
compare-and-set, but a message routed twice is held twice (as a routed QoS 0
message is delivered twice).

The keys are listed in :mod:`.keys`. Times are Redis's own clock (``TIME``),
in milliseconds, so nodes whose clocks differ agree on expiry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ....logs import OncePer, shown
from ...broker.persistent import DEFAULT_MAX_SESSIONS, TAKEOVER_GRACE
from ...broker.reports import Acked, AckedTogether, Attach, Detach, Discard, Inbound, Opened, Push, Report, Subscribed
from .. import Host
from .keys import NOTICE_MAXLEN, ROUTE_MAXLEN, ROUTE_TTL_MS, FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import OpenQuestion, Request
from .values import text

__all__ = [
    "EXPIRE_BATCH",
    "PersistentSessions",
    "opened_from",
    "session_call",
    "username_arg",
    "username_of",
]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")

EXPIRE_BATCH = 200
"""Sessions examined per expiry call (each node sweeps every ``renew`` seconds)."""


def session_call(report: Report, max_qos: int) -> tuple[str, list[str | bytes]] | None:
    """The session script's operation and arguments (from ARGV[12]) that apply ``report``;
    None if it changes nothing (a QoS 0 push: persistent sessions hold only 1 and 2)."""
    if isinstance(report, Attach):
        return "attach", [report.client_id, report.epoch, _ms(report.expiry)]
    if isinstance(report, Detach):
        return "detach", [report.client_id, report.epoch, _ms(report.expiry)]
    if isinstance(report, Subscribed):
        if report.qos is None:
            return "unsub", [report.client_id, report.topic_filter]
        return "sub", [report.client_id, report.topic_filter, str(min(report.qos, max_qos)), str(report.options)]
    if isinstance(report, Acked):
        return "ack", [report.client_id, report.epoch, report.kind, str(report.packet_id)]
    if isinstance(report, AckedTogether):
        return "acks", [report.client_id, report.epoch, report.acks]
    if isinstance(report, Inbound):
        return "inbound", [report.client_id, str(report.packet_id), "1" if report.held else "0"]
    if isinstance(report, Push):
        qos = min(report.qos, max_qos)
        if qos == 0:
            return None
        retain = "1" if report.retain else "0"
        return "push", [report.client_id, str(qos), retain, report.topic, report.payload, report.properties]
    if isinstance(report, Discard):
        return "discard", [report.client_id]
    raise TypeError(f"not a session report: {report!r}")


def _ms(expiry: int | None) -> str:
    """A session expiry as the script takes it: milliseconds, '' for none (unchanged, or the fleet's)."""
    return "" if expiry is None else str(expiry * 1000)


def username_arg(username: str | None) -> str:
    """How a username is stored with its session ('' for none: MQTT allows an empty one)."""
    return "" if username is None else "=" + username


def username_of(stored: bytes | str) -> str | None:
    """The inverse of :func:`username_arg`."""
    value = text(stored)
    return value[1:] if value.startswith("=") else None


def opened_from(reply: Any) -> Opened | None:
    """The open operation's reply: ``{present, {filter, qos, ...}, {inbound ids}, expired,
    {filter, options, ...}}`` (the options only for a resumed session); None for a
    present of -1 (refused: the fleet keeps as many sessions as it may); -2: none was
    stored and none made (a resume-only open)."""
    present, flat, inbound = int(reply[0]), list(reply[1] or []), reply[2] or []
    if present == -2:
        return Opened(False, {}, frozenset(), kept=False)
    if present < 0:
        return None
    subscriptions = {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
    pairs = list(reply[4] or []) if len(reply) > 4 else []
    options = {text(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
    return Opened(bool(present), subscriptions, frozenset(int(i) for i in inbound), options)


def _ignore(_: Any) -> None:
    return


class PersistentSessions:
    """This node's calls of the session script, with the fleet's bounds, and their replies counted.

    ``attached`` (client id -> epoch) is what this node's connections hold, kept by the
    coordinator as it reports attaches and detaches, for a resynchronisation.
    """

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        counts: FleetCounts,
        *,
        node: str,
        max_qos: int,
        window: int,
        window_bytes: int = 0,
        max_queued: int,
        max_queued_bytes: int,
        total_queued_bytes: int,
        expiry: float,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self.link = link
        self.max_sessions = max_sessions
        self._logged = OncePer()
        self.scripts = link.scripts
        self.counts = counts
        self.prefix = keys.prefix
        self.k_route = keys.psessions
        self.node = node
        self.max_qos = max_qos
        # The session script's fixed arguments after (prefix, node, op); the window's bytes
        # ride on its count (scripts.py) so that no other argument moves.
        window_arg = f"{window}/{window_bytes}" if window_bytes else str(window)
        self._bounds = [
            window_arg, str(max_queued), str(max_queued_bytes), str(total_queued_bytes),
            str(int(expiry * 1000)), str(ROUTE_MAXLEN), str(ROUTE_TTL_MS), str(NOTICE_MAXLEN),
        ]  # fmt: skip
        self.attached: dict[str, str] = {}

    def script(self, op: str, args: Sequence[str | bytes], client: Any) -> Any:
        """A call of the session script's operation ``op`` on ``client`` (a connection or a pipeline)."""
        # The key names the hub's slot, which routes the call on Redis Cluster; the script
        # derives every key it touches from the prefix.
        return self.scripts.session([self.k_route], [self.prefix, self.node, op, *self._bounds, *args], client=client)

    def request(self, report: Report, client: Any) -> list[Request]:
        """The call that applies ``report`` (none if it changes nothing)."""
        call = session_call(report, self.max_qos)
        if call is None:
            return []
        op, args = call

        def pushed(out: Any) -> None:
            if int(out) < 0:
                self.counts.persistent_dropped += 1
                if int(out) == -1:
                    self._full(args[0])

        def detached(out: Any) -> None:
            if int(out) == 2:
                self.counts.persistent_expired += 1  # its expiry was 0: it ended with its connection

        replied = {"push": pushed, "detach": detached}.get(op, _ignore)
        return [(self.script(op, args, client), replied)]

    def open_request(self, question: OpenQuestion, client: Any) -> list[Request]:
        """The call that answers ``question`` (none if its CONNECT was refused meanwhile)."""
        if question.abandoned:
            return []  # refused already: a session made now would only wait to expire

        def opened(out: Any) -> None:
            question.answer = opened_from(out)
            if int(out[3]):
                self.counts.persistent_expired += 1
            if question.answer is None:
                self.counts.persistent_refused += 1
                if self._logged.due("full", time.monotonic()):
                    logger.warning(
                        "node %s: persistent sessions at their bound (%d, --max-persistent-sessions): a new one"
                        " is refused (3); more are counted, not logged",
                        self.node,
                        self.max_sessions,
                    )
            question.done.set()

        v5 = "1" if question.v5 else "0"
        create = "1" if question.create else "0"
        args = [question.client_id, username_arg(question.username), str(self.max_sessions), v5]
        args += [_ms(question.expiry), create, _ms(TAKEOVER_GRACE)]
        return [(self.script("open", args, client), opened)]

    def routed(self, out: Any) -> None:
        """Count a route operation's reply: ``{pushed, dropped, {sessions newly full}}``."""
        self.counts.persistent_routed += int(out[0])
        self.counts.persistent_dropped += int(out[1])
        for client_id in out[2] or []:
            self._full(client_id)

    def _full(self, client_id: str | bytes) -> None:
        # Logged once per session (the script says which drop was its first), counted always.
        logger.warning(
            "node %s: persistent session %s is full: messages for it are dropped (counted)",
            self.node,
            shown(text(client_id)),
        )

    async def expire(self) -> int:
        """Discard the sessions whose clients stayed away past the expiry; how many this call did."""
        total = 0
        while True:
            call = self.script("expire", [str(EXPIRE_BATCH)], self.link.redis())
            expired, examined = await self.link.call(call)
            total += int(expired)
            if int(examined) < EXPIRE_BATCH:
                break
        if total:
            self.counts.persistent_expired += total
            logger.info("node %s: %d persistent sessions expired (their clients stayed away)", self.node, total)
        return total

    async def detach_lost(self, owner: str, client_ids: list[str], check_lease: bool) -> int:
        """Detach the sessions of ``client_ids`` that ``owner`` holds; -1 if its lease is
        back (with ``check_lease``)."""
        if not client_ids:
            return 0
        args = [owner, "1" if check_lease else "0", *client_ids]
        n = int(await self.link.call(self.script("lose", args, self.link.redis())))
        if n > 0:
            self.counts.persistent_detached += n
        return n

    async def reattach(self, host: Host, client_id: str, epoch: str) -> None:
        """After this node registered again: a session detached when it was declared lost
        is attached again (its messages resent), unless its client came back elsewhere;
        one Redis lost (restarted empty) is closed, so that its client reconnects, learns
        from CONNACK that the session is gone, and subscribes again."""
        args = [client_id, epoch]
        if int(await self.link.call(self.script("reattach", args, self.link.redis()))) >= 0:
            return
        if self.attached.get(client_id) == epoch:
            del self.attached[client_id]
            host.evict(client_id, epoch, "its persistent session was lost with Redis's data")
