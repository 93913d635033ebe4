"""What the processes of a heartbeat server share: client-id ownership, the device
registry, presence events and subscriptions beyond one process.

A worker (:class:`~servers.heartbeat.server.lifecycle.HeartbeatServer`) reports sessions
starting and ending to its :class:`Coordinator`; the coordinator decides, with the
rules of :mod:`.registry`, which presence events are published, and publishes each
exactly once: to the presence sinks (the log) and, through every worker's
:class:`Host`, to MQTT subscribers. Three implementations:

- :class:`~.inprocess.InProcessCoordinator`: a lone worker; nothing is shared.
- :class:`~.local.BusCoordinator`: workers of one supervisor, whose
  :class:`~.authority.Authority` holds the registry (the default with ``--workers``).
- :class:`~.fleet.RedisCoordinator`: gateways of a fleet on Redis (``--cluster``).

Keep-alive detection never waits on a coordinator: every call a worker makes here
returns at once (reports are queued), except :meth:`Coordinator.lookup`.

May import: :mod:`..mqtt`, :mod:`..presence` and :mod:`..broker` (the stores it keeps);
never the server that calls it (:mod:`..server`), which it reaches through :class:`Host`.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ...logs import OncePer, shown
from ...prometheus import Families, Metric
from ..broker.persistent import SessionStore
from ..broker.reports import Acked, AckedTogether, Opened, Report
from ..mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ..mqtt.publication import Publication
from ..presence.event import PresenceEvent, PresenceSink
from .durable.wills import HeldWill
from .retention import RetainedMessage, Retention
from .sys_figures import BrokerCounts

__all__ = [
    "LEAVE_TIMEOUT",
    "Coordinator",
    "Duty",
    "Health",
    "Host",
    "log_session_drops",
    "log_sessions_full",
    "publish_to_sinks",
    "retained_figures",
    "session_figures",
]

logger = logging.getLogger("servers.heartbeat.coordination")

LEAVE_TIMEOUT = 3.0
"""Seconds :meth:`Coordinator.leave` takes at most. A stopping worker has already given
its coordinator the shutdown's grace to drain, so this is a last try, not a wait: long
enough for one call that hangs (a fleet's call times out after 2 s) and a try on a new
connection after it. A coordinator that cannot finish within it gives up by itself and
says what it left undone, rather than be cancelled from outside without a word."""


class Host(Protocol):
    """What a coordinator needs from the worker it serves."""

    def deliver(self, message: Publication, groups: Collection[str] | None = None, plain: bool = True) -> None:
        """Hand ``message`` to this worker's own subscribers of its topic. ``groups``: the shared
        subscriptions (``$share/...``) this worker serves it to, one member each (None:
        every one held here that the topic reaches; empty: none, another worker or node
        was chosen); without ``plain``, to those groups alone (this worker was picked
        for them; its other subscribers have their copy from another delivery)."""
        ...

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        """Close session ``epoch`` of ``client_id`` if this worker holds it: it reconnected elsewhere.

        Its offline event has already been published by the coordinator; the worker
        still publishes the device's Will.
        """
        ...

    def sessions(self) -> list[PresenceEvent]:
        """The online event of every session this worker holds now (to resynchronise)."""
        ...

    def filters(self) -> set[str]:
        """Every topic filter this worker's subscribers hold now (to resynchronise)."""
        ...

    def transmit(self, client_id: str, epoch: str, packets: list[bytes], v5: bool = False) -> None:
        """Write ``packets`` (a persistent session's messages, written for MQTT 5.0 if
        ``v5``, else 3.1.1) to session ``epoch`` of ``client_id`` if this worker holds it."""
        ...


@dataclass(frozen=True, slots=True)
class Health:
    """Whether the coordinator is keeping up; ``/healthz`` says ``degraded`` when not."""

    ok: bool
    detail: str = ""


def publish_to_sinks(sinks: Iterable[PresenceSink], event: PresenceEvent) -> None:
    """Call every sink; one that raises is logged and does not stop the others."""
    for sink in sinks:
        try:
            sink(event)
        except Exception:
            logger.exception("presence sink %r raised", sink)


def log_sessions_full(store: SessionStore, logged: OncePer) -> None:
    """Log, once per spell, that new persistent sessions are refused (the store is full)."""
    if logged.due("sessions-full", time.monotonic()):
        logger.warning(
            "persistent sessions at their bound (%d, --max-persistent-sessions): a CONNECT with"
            " CleanSession=0 and no stored session is refused (3); more are counted, not logged",
            store.max_sessions,
        )


def log_session_drops(store: SessionStore) -> None:
    """Log, once per session, each persistent session that began to drop messages."""
    dropping = store.newly_dropping
    while dropping:
        client_id = shown(dropping.popleft())
        logger.warning("persistent session %s is full: messages for it are dropped (counted)", client_id)


def session_figures(store: SessionStore) -> list[Metric]:
    """Prometheus families of the persistent sessions a coordinator keeps."""
    f = Families({})
    f.gauge("heartbeat_persistent_sessions", "Persistent sessions kept (CleanSession=0).", len(store))
    f.gauge("heartbeat_persistent_queued_bytes", "Bytes queued for persistent sessions, over all.", store.queued_bytes)
    f.counter(
        "heartbeat_persistent_dropped_total",
        "Messages dropped for a full persistent session queue or the total bound.",
        store.dropped,
    )
    f.counter(
        "heartbeat_persistent_refused_total",
        "New persistent sessions refused: the store held --max-persistent-sessions.",
        store.refused,
    )
    f.counter(
        "heartbeat_persistent_expired_total",
        "Persistent sessions ended by their expiry: their client stayed away, or its expiry was 0.",
        store.expired,
    )
    f.counter(
        "heartbeat_persistent_expired_messages_total",
        "Messages held for a client (in flight or queued) that went with its expired session.",
        store.expired_messages,
    )
    return f.families


def retained_figures(retention: Retention) -> list[Metric]:
    """Prometheus families of a coordinator's retained messages."""
    store = retention.store
    f = Families({})
    f.gauge("heartbeat_retained_messages", "Retained messages kept (presence not included).", store.count)
    f.gauge("heartbeat_retained_bytes", "Bytes of retained topics and payloads.", store.bytes)
    f.counter("heartbeat_retained_refused_total", "Retained messages refused by the store's bounds.", store.refused)
    return f.families


class Duty(Protocol):
    """A task one node of a fleet performs at a time (:meth:`Coordinator.duty`)."""

    @property
    def renew_every(self) -> float:
        """Seconds between :meth:`hold` calls while holding it."""
        ...

    async def hold(self) -> bool:
        """Keep it if this node holds it, take it if free; whether this node holds it now."""
        ...

    async def release(self) -> None:
        """Give it up now, for another node to take."""
        ...


class Coordinator(abc.ABC):
    """The interface between one worker and whatever it shares state with."""

    #: ``$SYS/presence/``: where presence events are published for MQTT subscribers.
    presence_prefix: str = DEFAULT_PRESENCE_PREFIX

    #: Whether :meth:`acknowledged` refills a persistent session's window here, before it
    #: returns, so that what it releases is written in the same pass; False where the
    #: sessions live in another process (the supervisor's authority, Redis), whose refill
    #: comes back later.
    refills_here: bool = False

    @abc.abstractmethod
    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and serve ``host`` until cancelled; ``started()`` once reports are accepted."""

    def duty(self, name: str) -> Duty | None:
        """A claim on the task ``name`` that the whole fleet performs at one node at a time
        (a bridge); None where this coordinator serves one box (its worker 0 performs it)."""
        return None

    @abc.abstractmethod
    def online(self, event: PresenceEvent) -> None:
        """Session ``event.epoch`` was accepted; the device's previous session, anywhere, ends."""

    @abc.abstractmethod
    def offline(self, event: PresenceEvent, *, forget: bool = False) -> None:
        """Session ``event.epoch`` ended; its offline event is published unless already ended.

        ``forget``: the record is dropped afterwards (server-assigned client ids).
        """

    @abc.abstractmethod
    def note(self, event: PresenceEvent) -> None:
        """An event for the sinks only: a socket that never identified itself, a refusal."""

    @abc.abstractmethod
    def route(self, message: Publication, groups: Sequence[str] = (), *, origin: str = "") -> Sequence[str]:
        """Deliver a device's ``message`` to matching subscribers of the *other* workers,
        and to the persistent sessions (``origin``, the publisher's client id, for their
        No Local).

        ``groups`` are the shared subscriptions held on this worker that the topic
        reaches; each must get the message once, fleet-wide. Returns those this worker
        serves itself; the coordinator sees to the others (and to groups held only
        elsewhere)."""

    def pass_on(self, message: Publication, group: str) -> bool:
        """A QoS 1 or 2 message of shared subscription ``group`` that a member here left
        unacknowledged, with no other member here to take it: give it to a member on
        another worker or gateway. False if there is none (it is lost, and counted)."""
        return False

    @abc.abstractmethod
    def filters_changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        """Since the last call, this worker's subscribers came to hold ``added`` (each
        filter's first subscriber) and let go of ``removed`` (its last one left).

        Only what changed, so a SUBSCRIBE costs the same however many filters the worker
        holds; where the whole set is needed (a new link), :meth:`Host.filters` gives it.
        A filter named again in ``added`` (or one not held, in ``removed``) is no change."""

    def settles(self) -> bool:
        """Whether :meth:`settle` can wait: other workers or nodes route by this one's
        filters, so a new subscription reaches them some time after it is made."""
        return False

    async def settle(self) -> bool:
        """Return once every other worker or node routes by the filters and session
        reports made here so far; False if that could not be confirmed in time.

        A SUBACK waits for it: a client that subscribes, is answered, and then has a
        message published (say, a request whose reply comes on the topic) must get the
        reply, wherever the publisher is connected."""
        return True

    @abc.abstractmethod
    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """The device's last presence event, from whichever worker or node held it."""

    async def overview(self, query: str = "", limit: int = 100) -> dict[str, Any] | None:
        """What the operator's page shows of the registry, from one snapshot: ``online``
        (devices online now), ``records`` (devices known, online or not; None where
        counting them would cost a scan), ``as_of`` (its wall-clock time), ``scope``
        (``worker``, ``box`` or ``fleet``) and :meth:`.RecentEnds.answer`'s keys: the
        latest ends of client ids containing ``query``, at most ``limit``. None if the
        keeper of the registry does not answer in time."""
        return None

    @abc.abstractmethod
    async def drain(self) -> None:
        """Wait until every report made so far has been published (a shutdown's first phase)."""

    def progress(self) -> int:
        """A count that grows whenever the coordinator moves on (applies or reads something):
        a drain that takes long but keeps moving is given more time than one that is stuck."""
        return 0

    async def leave(self) -> None:
        """The worker is stopping and has ended its sessions: settle any whose report did
        not get through (reason ``shutdown``) and leave, rather than wait to be declared
        lost. Returns within :data:`LEAVE_TIMEOUT` and raises nothing: a stop is a stop
        whatever the store does (callers still bound it, against one that does not keep
        to this). Nothing to do where the holder's own process keeps the registry or
        reports reach it in order (the default)."""
        return

    async def flush(self) -> None:
        """Wait until every report made so far has been published (no barrier with others)."""
        await self.drain()

    # -- durability (--persistence); by default nothing waits -----------------------------

    def commit_mark(self) -> int | None:
        """A mark of the changes reported so far, if some wait to be made durable and an
        acknowledgement must wait for them (``--persistence-sync always``); None if none
        wait. Taken after a PUBLISH's retain and route: its PUBACK waits for :meth:`committed`."""
        return None

    async def committed(self, mark: int) -> bool:
        """Wait until the changes up to ``mark`` are durable; False if they could not be
        made so (the store cannot write, or its owner is gone)."""
        return True

    #: Whether delayed Wills are kept across a restart: a stopping worker then leaves
    #: them waiting (the next start waits out the rest) instead of sending them.
    keeps_wills: bool = False

    def will_held(self, held: HeldWill) -> None:
        """A Will waits out its delay on this worker (kept, where the state is durable)."""
        return

    def will_done(self, client_id: str, epoch: str) -> None:
        """The Will session ``epoch`` of ``client_id`` left was sent or dropped."""
        return

    async def pending_wills(self) -> list[HeldWill]:
        """The delayed Wills a restart found still waiting, for this worker to wait out
        (one worker of a box gets them: the first)."""
        return []

    # -- persistent sessions (CleanSession=0); by default none is kept -------------------

    async def open_session(
        self,
        client_id: str,
        username: str | None = None,
        v5: bool = False,
        *,
        expiry: int | None = None,
        create: bool = True,
    ) -> Opened | None:
        """A CONNECT with CleanSession=0 was accepted: the stored session to resume (or a
        new one, kept ``expiry`` seconds after its client leaves until its CONNACK's
        :class:`~..broker.reports.Attach` says otherwise; none without ``create``), for an
        MQTT 5.0 client if ``v5``. Awaited before CONNACK, whose session-present flag it
        decides; None if the owner of the sessions cannot answer now (the CONNECT is
        refused, 3)."""
        return Opened(False, {}, frozenset(), kept=create)

    def discard_session(self, client_id: str) -> None:
        """A CONNECT with CleanSession=1 was accepted: any stored session is discarded."""
        return

    def session(self, report: Report) -> None:
        """A change to a persistent session, in the order its connection made it."""
        return

    def acknowledged(self, client_id: str, epoch: str, acks: Sequence[tuple[str, int]]) -> None:
        """Acknowledgements (kind and packet id) that connection ``epoch`` of a persistent
        session read together, in order: one report for them all (:class:`AckedTogether`),
        so that whoever keeps the session refills its window once and sends the refill
        in one piece (one frame to a worker, one route entry to a gateway)."""
        if len(acks) == 1:
            kind, packet_id = acks[0]
            self.session(Acked(client_id, epoch, kind, packet_id))
        elif acks:
            self.session(AckedTogether.pack(client_id, epoch, acks))

    # -- retained messages; by default none is kept --------------------------------------

    def retain(self, topic: str, payload: bytes, qos: int, owner: str = "", properties: bytes = b"") -> None:
        """A PUBLISH with RETAIN=1 from client ``owner``: kept for later subscribers, within
        the owner's share (an empty payload clears; a refusal keeps the old message). An
        MQTT 5 publisher's ``properties`` (packed) are kept with it, and its Message Expiry
        Interval, if any, ends its retention."""
        return

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """A page of the retained messages ``topic_filter`` matches, presence included,
        and the cursor of the next page (None: no more)."""
        return [], None

    # -- $SYS/broker ------------------------------------------------------------------------

    async def broker_counts(self, own: BrokerCounts) -> BrokerCounts:
        """What ``$SYS/broker`` publishes, from this worker's own counts (``own``): with
        what this coordinator keeps (persistent sessions, retained messages) and, in a
        box, summed over its workers. By default ``own``: a fleet node publishes its own."""
        return own

    @abc.abstractmethod
    def health(self) -> Health:
        """Whether reports are flowing."""

    def figures(self) -> list[Metric]:
        """Prometheus families of this coordinator's own figures."""
        return []
