"""Fan-out: clients' messages to every subscriber, here (the broker) and on other
workers (the coordinator); subscriptions made and dropped, and held until the other
workers route by them; the steps of QoS 1 and 2 exchanges."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

import trio

from ...logs import OncePer, shown
from ..broker.budget import SendBudget
from ..broker.outbox import Message, Stage
from ..broker.reports import Inbound, Push, Subscribed
from ..broker.routing import Broker
from ..config import HeartbeatConfig
from ..coordination import Coordinator
from ..mqtt.effects import (
    Acknowledged,
    AddSubscription,
    Denied,
    HoldInbound,
    ReleaseInbound,
    RemoveSubscription,
    SubscriptionRefused,
    TooLarge,
    Will,
)
from ..mqtt.publication import Publication
from .connection import Connection
from .retained_delivery import RetainedDelivery

__all__ = ["Exchange", "FanOut"]

logger = logging.getLogger("servers.heartbeat")

Exchange = Acknowledged | HoldInbound | ReleaseInbound | Denied | SubscriptionRefused | TooLarge
"""Session effects both engines hand to :meth:`FanOut.exchanged` as they are."""


class FanOut:
    """Who gets what this worker's clients publish, and what its subscribers are sent.

    ``counters`` is the worker's; ``nursery`` is where retained deliveries run.
    """

    def __init__(
        self,
        config: HeartbeatConfig,
        coordinator: Coordinator,
        counters: collections.Counter[str],
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.coordinator = coordinator
        self.counters = counters
        self.nursery = nursery
        budget: SendBudget[Connection] = SendBudget(
            lambda conn: conn.queued(),
            trio.current_time,
            config.max_subscriber_bytes,
            config.max_outbox_bytes,
            grace=config.send_timeout,
        )
        self.broker: Broker[Connection] = Broker(
            config.max_qos, budget, config.max_inflight, config.max_queued, window_bytes=config.max_inflight_bytes
        )
        self.broker.checks_reads = config.acl is not None
        self.broker.persist = self._persist
        self.broker.unserved = self._elsewhere
        self.retained = RetainedDelivery(coordinator, self.broker, nursery, lambda conn: conn in self.unsettled)
        self.unsettled: dict[Connection, list[AddSubscription]] = {}
        """Connections whose next reply (the SUBACK, or a PUBACK waiting for a commit)
        waits for :meth:`settle`, with the subscriptions whose retained messages follow it."""
        self.commits: dict[Connection, int] = {}
        """Connections whose next reply waits for the durable store to commit this change
        count (the changes their PUBLISH or SUBSCRIBE made), then :meth:`settle` sends it."""
        self._settle_failing = False
        self._filter_changes = self.broker.subscriptions.track()
        self._logged = OncePer()

    def published(self, conn: Connection, message: Publication) -> None:
        """A client's PUBLISH: count it and route it to every subscriber (retained,
        it is kept for later ones, within the client's share; existing subscribers get
        it without the flag)."""
        counters = self.counters
        counters["messages_in"] += 1
        counters["publish_bytes_in"] += len(message.payload)  # $SYS/broker/publish/bytes/received
        if message.retain:
            self.coordinator.retain(
                message.topic, message.payload, message.qos, conn.session.client_id or "", message.properties
            )
        self.route(message, conn)
        if message.qos:
            self._hold_for_commit(conn)

    def _hold_for_commit(self, conn: Connection) -> None:
        """Hold ``conn``'s next replies until what it changed so far is durable (if
        anything waits to be): the engines gather them and call :meth:`committed`."""
        mark = self.coordinator.commit_mark()
        if mark is not None:
            self.commits[conn] = mark

    def publish_will(self, client_id: str, will: Will) -> None:
        """A device died: its Will goes out like its own PUBLISH would have."""
        self.counters["wills_published"] += 1
        if will.retain:
            self.coordinator.retain(will.topic, will.message, will.qos, client_id, will.properties)
        self.route(Publication(will.topic, will.message, will.qos, will.retain, will.properties))

    def route(self, message: Publication, origin: Connection | None = None) -> int:
        """Deliver ``message`` to every subscriber of its topic, here and on other workers.

        Returns how many local subscribers got it; the coordinator passes it on to
        other workers or gateways whose subscribers want it, with the publisher's
        MQTT 5 properties and retain flag (for Retain As Published); ``origin``, the
        publishing connection, is skipped by its own No Local subscriptions.
        """
        broker = self.broker
        publisher = "" if origin is None else origin.session.client_id or ""
        groups = self.coordinator.route(message, broker.subscriptions.groups(message.topic), origin=publisher)
        return broker.deliver(message, origin=origin, groups=groups)

    def subscribed(self, conn: Connection, effect: AddSubscription) -> None:
        """The client subscribed: from now on it is sent what matches (within ``send_timeout``)."""
        if conn.finished:
            return  # its end has been dealt with: nothing would ever drop this subscription
        self.broker.subscriptions.subscribe(conn, effect.topic_filter, effect.qos, effect.options)
        self.retained.expect(conn, effect)
        conn.stream.send_timeout = self.config.send_timeout
        if conn.persistent:
            client_id = conn.session.client_id or ""
            self.coordinator.session(Subscribed(client_id, effect.topic_filter, effect.qos, effect.options))
            if effect.suback:
                self._hold_for_commit(conn)
        changed = self.announce_filters()
        if effect.suback and (conn in self.unsettled or ((changed or conn.persistent) and self.coordinator.settles())):
            self.unsettled.setdefault(conn, []).append(effect)  # retained ones go after the SUBACK
        else:
            # After the SUBACK, which the session's effects put after this one.
            self.retained.start(conn, effect)

    async def settle(self, conn: Connection) -> None:
        """Hold a SUBACK until what the client changed is durable (a persistent session's
        subscription, ``--persistence-sync always``; the replies held for a commit before
        it the engine has released through :meth:`committed`), and until the other
        workers route by the subscription.

        Without the settling, a message published on another worker just after the SUBACK could
        miss the subscriber: filters reach other workers a few milliseconds later. Costs
        a round trip to every worker, only when a filter is new here or the session
        persistent; a stalled worker holds it up for at most the lookup timeout."""
        mark = self.commits.pop(conn, None)
        if mark is not None and not await self.coordinator.committed(mark):
            self._uncommitted(conn)  # a SUBACK has no refusal for it: it goes as it is
        subscriptions = self.unsettled.pop(conn, [])
        await self._settle(conn, subscriptions)

    async def committed(self, conn: Connection, replies: list[bytes]) -> list[bytes]:
        """Wait until what ``conn`` changed is durable: a message retained or queued for a
        persistent session is acknowledged once it is committed (``--persistence-sync
        always``). Returns the replies to send then: a commit that failed (a full disk)
        turns an MQTT 5 PUBACK into 0x97 (the message may still be kept: it is retried)."""
        mark = self.commits.pop(conn, None)
        if mark is None or await self.coordinator.committed(mark):
            return replies
        return [self._refused(conn, reply) for reply in replies]

    def _refused(self, conn: Connection, reply: bytes) -> bytes:
        """A reply whose change could not be committed: counted, and an MQTT 5 PUBACK says so."""
        self._uncommitted(conn)
        if conn.v5 is not None and len(reply) == 4 and reply[0] == 0x40:
            return reply[:1] + b"\x03" + reply[2:4] + b"\x97"  # PUBACK, Quota Exceeded
        return reply

    def _uncommitted(self, conn: Connection) -> None:
        """Count a reply whose change the durable store could not commit (logged once a spell)."""
        self.counters["durable_unconfirmed"] += 1
        if self._logged.due("uncommitted", time.monotonic()):
            logger.warning(
                "%s: a change of %s could not be committed (the durable store cannot write, see /healthz);"
                " an MQTT 5 PUBACK says 0x97, others are acknowledged as kept in memory and retried;"
                " heartbeat_durable_unconfirmed_total counts them",
                conn.peer,
                shown(conn.session.client_id or ""),
            )

    async def _settle(self, conn: Connection, subscriptions: list[AddSubscription]) -> None:
        self.counters["subscribe_settles"] += 1
        settled = await self.coordinator.settle()
        for effect in subscriptions:  # they start once the caller has written the SUBACK
            self.retained.start(conn, effect)
        if settled:
            self._settle_failing = False
            return
        self.counters["subscribe_settle_timeouts"] += 1
        if not self._settle_failing:  # once per spell, not once per SUBSCRIBE of a stall
            self._settle_failing = True
            logger.warning(
                "a SUBACK to %s went before every worker confirmed its subscription (one stalled?);"
                " heartbeat_subscribe_settle_timeouts_total counts them",
                conn.peer,
            )

    def unsubscribed(self, conn: Connection, effect: RemoveSubscription) -> None:
        """The client dropped a subscription."""
        self.broker.subscriptions.unsubscribe(conn, effect.topic_filter)
        if conn.persistent:
            self.coordinator.session(Subscribed(conn.session.client_id or "", effect.topic_filter, None))
        self.announce_filters()

    def exchanged(self, conn: Connection, effect: Exchange) -> None:
        """A step of a QoS 1 or 2 exchange: the client's outbox (or its persistent session)
        takes it; or a PUBLISH denied or a filter refused, counted (and logged once per
        client per spell: a client may repeat them at will)."""
        client_id = conn.session.client_id or ""
        if isinstance(effect, Denied):
            self.counters["denied_publishes"] += 1
            self._refusal(conn, "publish", f"publish to {shown(effect.topic)} denied")
            return
        if isinstance(effect, TooLarge):
            self.counters["dropped_too_large"] += 1
            what = f"a {effect.size}-byte payload to {shown(effect.topic)} dropped: over --message-size-limit"
            self._refusal(conn, "too-large", what)
            return
        if isinstance(effect, SubscriptionRefused):
            self.counters["refused_subscriptions"] += 1
            why = "it holds as many filters as allowed (--max-subscriptions, --max-subscription-bytes)"
            self._refusal(conn, "subscribe", f"subscription to {shown(effect.topic_filter)} refused: {why}")
            return
        if isinstance(effect, Acknowledged):
            self.acknowledged(conn, ((effect.kind, effect.packet_id),))
        elif conn.persistent:
            held = isinstance(effect, HoldInbound)
            self.coordinator.session(Inbound(client_id, effect.packet_id, held))

    def acknowledged(self, conn: Connection, acks: Sequence[tuple[str, int]]) -> None:
        """PUBACKs, PUBRECs and PUBCOMPs (kind and packet id) the client sent together, in
        order: its outbox (or its persistent session) takes them at once, and what they
        release (the PUBRELs, then the messages that take the freed places) is written
        in one piece."""
        if conn.persistent:
            online = conn.online
            assert online is not None
            self.coordinator.acknowledged(conn.session.client_id or "", online.epoch, acks)
            return
        box = conn.held
        if box is None:
            return  # an ack for nothing we sent: MQTT leaves it to the server
        expired = box.expired
        released = box.acknowledge(acks)
        self.broker.expired += box.expired - expired  # MQTT 5 messages whose lifetime ran out queued
        if released:
            self.broker.write(conn, released)

    def _refusal(self, conn: Connection, kind: str, what: str) -> None:
        """Log a refusal of ``conn``'s, once per client and kind per spell: a client may
        repeat it at will, and the counters carry the totals."""
        client_id = conn.session.client_id or ""
        if self._logged.due((client_id, kind), time.monotonic()):
            logger.info("%s (%s): %s; more are counted, not logged", conn.peer, shown(client_id), what)

    def _persist(self, conn: Connection, message: Message) -> None:
        """A QoS 1 or 2 message given to one persistent session (a shared subscription's,
        a retained one for a new subscription): its store keeps it, with its MQTT 5
        properties for a 5.0 client."""
        client_id = conn.session.client_id or ""
        push = Push(client_id, message.topic, message.payload, message.qos, message.retain, message.properties or b"")
        self.coordinator.session(push)

    def forget(self, conn: Connection) -> None:
        """``conn`` ended: nothing waits for its SUBACK, its queue no longer counts, and
        its subscriptions go (the other workers are told if the filters changed). The
        QoS 1 and 2 messages it had from shared subscriptions and did not acknowledge
        go to another member of the group: on this worker if one is here, else on
        another worker or gateway (counted as lost if there is none)."""
        self.unsettled.pop(conn, None)
        self.commits.pop(conn, None)
        broker = self.broker
        box = conn.held
        if box is not None and not conn.persistent:
            for message in [*box.inflight(), *box.queued()]:
                if message.group and message.stage is Stage.PUBLISHED:
                    self._pass_on(conn, message)
        broker.forget(conn)
        if broker.subscriptions.has(conn):
            broker.subscriptions.drop(conn)
            self.announce_filters()

    def _pass_on(self, conn: Connection, message: Message) -> None:
        picked = self.broker.member(message.group, skip=conn)
        if picked is None:
            self._elsewhere(message)
            return
        sub, qos = picked
        level = min(message.qos, qos)
        copy = Message(message.topic, message.payload, level, message.retain, message.properties, message.group)
        self.counters["shared_passed_on"] += self.broker.give_message(sub, copy)

    def _elsewhere(self, message: Message) -> None:
        """A shared subscription's message with no member here to take it: to one on
        another worker or gateway, if any holds the group."""
        m = message
        if self.coordinator.pass_on(Publication(m.topic, m.payload, m.qos, m.retain, m.properties or b""), m.group):
            self.counters["shared_passed_elsewhere"] += 1
        else:
            self.counters["shared_unacknowledged_lost"] += 1

    def filters(self) -> set[str]:
        """Every filter this worker's subscribers hold."""
        return self.broker.subscriptions.filters()

    def announce_filters(self) -> bool:
        """Tell the coordinator which filters came and went since the last call (a step
        per filter that did, however many are held); returns whether any did."""
        changes = self._filter_changes
        if not changes:
            return False
        self.coordinator.filters_changed(*changes.take())
        return True
