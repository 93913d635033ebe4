"""The supervisor's side of the local coordinator: one registry for every worker.

Runs in the supervisor process (plain Python, no trio), as the handler of its
:class:`~servers.bus.Hub`. Workers report sessions starting and ending; the
authority applies the registry's rules and publishes each presence event once:
to the presence log, and to every worker whose subscribers want it (the reporting
worker included, so that every subscriber sees one order). When a worker process
dies, every session it held goes offline here with reason ``worker-lost``; its
last reports, still in the socket, are applied first.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from ...bus import Link
from ...logs import OncePer
from ..broker.reports import Attach, Delivery
from ..broker.topics import FilterIndex
from ..mqtt.endings import Offline
from ..mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ..presence.event import PresenceEvent, PresenceSink
from ..presence.overview import RecentEnds, registry_overview
from . import frames, log_session_drops, log_sessions_full, publish_to_sinks
from .durable import Durability
from .durable.box import BoxCommits
from .durable.driver import restored
from .holders import Holders
from .probes import Probes
from .registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .registry import Registry
from .retention import MqttState, live_presence
from .spread import Spread
from .sys_figures import BoxTotals, BrokerCounts, with_store

__all__ = ["Authority", "epoch_of"]

logger = logging.getLogger("servers.heartbeat.authority")


def epoch_of(worker: int, pid: int, number: int, node: str = "") -> str:
    """A session's epoch: unique across workers, restarts (the pid) and nodes.

    A fleet node's name already names its worker process (``gw0/w1/<pid>``).
    """
    return f"{node}/{number}" if node else f"{worker}.{pid}.{number}"


def _held_by(worker: int, pid: int) -> Callable[[PresenceEvent], bool]:
    prefix = f"{worker}.{pid}."
    return lambda event: event.epoch.startswith(prefix)


# Seconds between sweeps for persistent sessions and retained messages that expired.
_SWEEP_EVERY = 60.0
# The persistent sessions' filters, as a holder beside the links (numbered from 1).
_SESSIONS = -1


@dataclass
class _Peer:
    link: Link
    worker: int = -1
    pid: int = 0
    index: FilterIndex = field(default_factory=FilterIndex)
    """Its worker's filters, matched per message without a scan of them."""
    acked: int = 0
    seq: int = 0
    drained: bool = False
    incarnation: str = ""


class Authority:
    """Applies workers' reports to one registry and publishes the events (a hub's handler)."""

    def __init__(
        self,
        sinks: Sequence[PresenceSink] = (),
        *,
        presence_prefix: str = DEFAULT_PRESENCE_PREFIX,
        max_records: int = 1_000_000,
        max_record_bytes: int = DEFAULT_RECORD_BYTES,
        clock: Callable[[], float] = time.time,
        state: MqttState | None = None,
        durability: Durability | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.presence_prefix = presence_prefix
        self.registry = Registry(max_records, max_record_bytes)
        self.recent = RecentEnds()
        """The latest ends, for the operator's page (every worker's asks it)."""
        self._clock = clock
        state = state if state is not None else MqttState()
        self.store = state.store
        self._logged = OncePer()
        """Every worker's persistent sessions: a reconnect on another worker, or after a
        worker died, finds its session here."""
        self.retention = state.retention(self.registry, presence_prefix, clock)
        self._swept = clock()
        self._peers: dict[int, _Peer] = {}
        self._spread: Spread[_Peer] = Spread(self._peers)
        self._holders: Holders[int] = Holders()
        """Every link's filters and the persistent sessions', and what each worker routes by."""
        self._persistent = self.store.subscriptions.track()
        self._holders.change(_SESSIONS, *self._persistent.take())
        self._workers: dict[int, int] = {}  # pid -> worker index, for every pid that said hello
        # The highest number applied from each worker process's coordinator (its
        # incarnation): a frame resent after a dropped link is acknowledged, not applied again.
        self._applied: dict[str, int] = {}
        self._incarnations: dict[int, set[str]] = {}  # pid -> its incarnations, forgotten when it exits
        self._probes: Probes[_Peer] = Probes(self._peers)
        self._box = BoxTotals()  # each worker's latest $SYS/broker counts
        self.published = 0
        self.lost = 0
        self.dropped_links = 0
        self.repeats = 0
        """Numbered frames that came again after a dropped link and were not applied twice."""
        self.stale_attaches = 0
        """Persistent sessions' attaches refused: their connection had already lost the client id."""
        self.durability = durability
        """Where the box's state is kept across restarts (None: in memory only). The
        authority commits on its own thread: it serves no socket a slow disk could hold up."""
        self.stopping = False
        """The box is stopping: sessions ended by it stay online in a durable record
        (the next start ends them, ``server-shutdown``)."""
        self._commits = None if durability is None else BoxCommits(durability)
        if durability is not None:
            for event in restored(durability, self.registry, self.retention, self.store, self.recent, self.sinks):
                self._publish(event)

    @property
    def shared_lost(self) -> int:
        """Shared subscriptions' unacknowledged messages passed on with no member left to take them."""
        return self._spread.shared_lost

    # -- LinkHandler ---------------------------------------------------------------

    def connected(self, link: Link) -> None:
        """A worker connected; it says who it is in its first frame."""
        self._peers[link.number] = _Peer(link, pid=link.pid, index=self._holders.index(link.number))

    def received(self, link: Link, line: bytes) -> None:
        """Apply one frame."""
        peer = self._peers.get(link.number)
        if peer is None:
            return
        try:
            frame = frames.decode(line)
        except frames.FrameError as exc:
            logger.warning("authority: %r sent a bad frame, ignored: %s", link, exc)
            return
        self._apply(peer, frame)

    def batch_done(self, link: Link) -> None:
        """Acknowledge every numbered report of the batch at once (with a durable store
        in sync ``always``, once the round's commit has them: :meth:`round_done`)."""
        peer = self._peers.get(link.number)
        if peer is None or peer.seq <= peer.acked:
            return
        if self._commits is None or not self._commits.defer(link.number, lambda ok: self._ack(peer, ok)):
            self._ack(peer, True)

    def _ack(self, peer: _Peer, durable: bool) -> None:
        if self._peers.get(peer.link.number) is peer and peer.seq > peer.acked:
            peer.acked = peer.seq
            peer.link.send(frames.encode(frames.Ack(peer.seq, durable=durable)))

    def round_done(self) -> None:
        """The hub moved what was ready: the durable store's group commit (:class:`.BoxCommits`)."""
        if self._commits is not None:
            self._commits.round_done()

    def wake_in(self) -> float | None:
        """Seconds until a timed commit is due (None: none is)."""
        return None if self._commits is None else self._commits.wake_in()

    def stop(self) -> None:
        """The supervisor is stopping the box (a signal): the sessions its workers end
        from now on for the shutdown stay online in a durable record."""
        self.stopping = True

    def close(self) -> None:
        """The supervisor is done: the last commit, and the durable file marked stopped."""
        if self.durability is not None:
            self.durability.close(clean=True)

    def disconnected(self, link: Link, overflowed: bool) -> None:
        """A link is gone. Its sessions stay: the worker may be alive (see :meth:`process_exited`)."""
        peer = self._peers.pop(link.number, None)
        if peer is None:
            return
        if overflowed:
            self.dropped_links += 1
            logger.warning(
                "authority: worker %d (pid %d) stopped reading; its link was dropped and it will resynchronise",
                peer.worker,
                peer.pid,
            )
        self._holders.leave(link.number)
        self._box.forget(link.number)
        self._filters_changed()
        self._check_drained()
        self._probes.gone(link.number)

    def worker_of(self, link: Link) -> int | None:
        """The index of the worker at the other end of ``link``, once it has said hello."""
        peer = self._peers.get(link.number)
        return None if peer is None or peer.worker < 0 else peer.worker

    def process_exited(self, pid: int, code: int | None) -> list[PresenceEvent]:
        """A worker process died: every session it held goes offline, ``worker-lost``."""
        for incarnation in self._incarnations.pop(pid, ()):
            self._applied.pop(incarnation, None)
        worker = self._workers.pop(pid, None)
        if worker is None:
            return []
        detail = f"worker {worker} (pid {pid}) exited" + ("" if code is None else f" with {code}")
        return self.worker_lost(worker, pid, detail)

    def worker_lost(self, worker: int, pid: int, detail: str) -> list[PresenceEvent]:
        """Every session worker ``worker`` (process ``pid``) held goes offline, ``worker-lost``
        (unless the box is stopping with a durable store: the next start ends them)."""
        if self.durability is not None and self.stopping:
            self.store.detach_held(lambda holder: str(holder).startswith(f"{worker}.{pid}."), self._clock())
            return []
        lost = self.registry.lose(_held_by(worker, pid), Offline.WORKER_LOST, detail, self._clock())
        for event in lost:
            self._publish(event)
        # Its persistent sessions wait for their clients, unacknowledged messages kept.
        prefix = f"{worker}.{pid}."
        self.store.detach_held(lambda holder: str(holder).startswith(prefix), self._clock())
        self.lost += len(lost)
        if lost:
            logger.warning("authority: %s; %d devices declared offline", detail, len(lost))
        return lost

    # -- frames ----------------------------------------------------------------------

    def _first_time(self, peer: _Peer, seq: int) -> bool:
        """Note numbered frame ``seq`` for the next acknowledgement; whether it is new.

        A worker numbers its frames in the order it sends them and resends, after a
        dropped link, from its oldest unacknowledged one, so what each link brings is a
        run of consecutive numbers: anything at or below the highest applied is a repeat.
        """
        peer.seq = max(peer.seq, seq)
        if not peer.incarnation:
            return True
        if seq <= self._applied.get(peer.incarnation, 0):
            self.repeats += 1
            return False
        self._applied[peer.incarnation] = seq
        return True

    def _apply(self, peer: _Peer, frame: frames.Frame) -> None:
        seq = frame.seq if isinstance(frame, frames.Numbered) else 0
        if seq and not self._first_time(peer, seq):
            return
        if isinstance(frame, frames.Reported):
            report = frame.report
            if isinstance(report, Attach) and not self._owns(report.client_id, report.epoch):
                # A session whose claim lost to a newer one (they crossed): it is being
                # evicted, and the session's messages stay with the one that holds the id.
                self.stale_attaches += 1
                return
            self._transmit(self.store.apply(report, self._clock()))
        elif isinstance(frame, frames.Kept):
            self.retention.retain(frame.topic, frame.payload, frame.qos, frame.owner, frame.properties)
        elif isinstance(frame, frames.OpenSession):
            stored = self.store.get(frame.client_id)
            if (
                stored is not None
                and stored.holder is not None
                and not str(stored.holder).startswith(f"{peer.worker}.{peer.pid}.")
            ):
                # Held by a connection on another worker, whose end may still be on its
                # way (a DISCONNECT that set the expiry to 0, and a reconnect that landed
                # here): links deliver in order, so once that worker answers a probe,
                # whatever it reported before has been applied.
                self._probes.probe(peer, lambda requester: self._open(requester, frame))
            else:
                self._open(peer, frame)
        elif isinstance(frame, frames.RetainedQuery):
            messages, cursor = self.retention.page(frame.topic_filter, frame.cursor)
            peer.link.send(frames.encode(frames.RetainedPage(frame.request, messages, cursor)))
        elif isinstance(frame, frames.Claimed):
            self._online(frame.event)
        elif isinstance(frame, frames.Ended):
            if self.durability is not None and self.stopping and frame.event.reason is Offline.SHUTDOWN:
                pass  # the box is stopping: the next start ends it (server-shutdown)
            elif self.registry.offline(frame.event, forget=frame.forget) is not None:
                self._publish(frame.event)
        elif isinstance(frame, frames.Routed) and frame.group:
            self._spread.pass_on(frames.Deliver(frame.message, frame.group), skip=peer)
        elif isinstance(frame, frames.Routed):
            self._spread.deliver(frames.Deliver(frame.message), skip=peer)
            for delivery in self.store.route(frame.message, frame.origin):
                self._transmit(delivery)
            log_session_drops(self.store)
        elif isinstance(frame, frames.WillHeld | frames.WillDone | frames.WillsQuery):
            answer = None if self._commits is None else self._commits.wills(frame, first=peer.worker == 0)
            if isinstance(frame, frames.WillsQuery):
                peer.link.send(frames.encode(answer or frames.WillsFound(frame.request, [])))
        elif isinstance(frame, frames.Noted):
            publish_to_sinks(self.sinks, frame.event)
        elif isinstance(frame, frames.FiltersChanged):
            self._holders.change(peer.link.number, frame.added, frame.removed)
        elif isinstance(frame, frames.Filters):
            self._holders.replace(peer.link.number, frame.filters)
        elif isinstance(frame, frames.Lookup):
            peer.link.send(frames.encode(frames.Found(frame.request, self.registry.get(frame.client_id))))
        elif isinstance(frame, frames.Overview):
            registry = self.registry
            body = registry_overview("box", registry.online_count, len(registry), self.recent, frame.query, frame.limit)
            peer.link.send(frames.encode(frames.OverviewFound(frame.request, json.dumps(body, separators=(",", ":")))))
        elif isinstance(frame, frames.BoxFigures):
            summed = self._box.report(peer.link.number, BrokerCounts.from_values(frame.values))
            totals = with_store(summed, self.store, self.retention)
            peer.link.send(frames.encode(frames.BoxFigures(frame.request, totals.values())))
        elif isinstance(frame, frames.Hello):
            peer.worker, peer.pid = frame.worker, peer.pid or frame.pid
            peer.incarnation = frame.incarnation
            self._workers[peer.pid] = peer.worker
            self._incarnations.setdefault(peer.pid, set()).add(frame.incarnation)
            peer.link.send(frames.encode(frames.RemoteFilters(self._holders.listen(peer.link.number))))
        elif isinstance(frame, frames.Resync):
            self._resync(peer, frame.sessions)
        elif isinstance(frame, frames.Settle):
            self._settle(peer, frame.request)
        elif isinstance(frame, frames.Probed):
            self._probes.answered(frame.token, peer.link.number)
        elif isinstance(frame, frames.Drained):
            peer.drained = True
            self._check_drained()
        else:
            logger.warning("authority: unexpected %s from worker %d", type(frame).__name__, peer.worker)
        now = self._clock()
        if now - self._swept > _SWEEP_EVERY:
            self._swept = now
            self.store.expire(now)
            self.retention.store.prune(now)
        # Whatever this frame changed (a worker's filters, a persistent session's, by a
        # report, an open or the sweep) goes out before the next frame is applied: a
        # Settle's probes must follow the changes made by the frames before it.
        self._filters_changed()

    def _owns(self, client_id: str, epoch: str) -> bool:
        """Whether session ``epoch`` holds ``client_id`` now (its claim came after every other)."""
        record = self.registry.get(client_id)
        return record is not None and record.status == "online" and record.epoch == epoch

    def _open(self, peer: _Peer, frame: frames.OpenSession) -> None:
        opened = self.store.open(
            frame.client_id,
            False,
            self._clock(),
            frame.username,
            frame.v5,
            expiry=frame.expiry,
            create=frame.create,
        )
        if opened is None:
            log_sessions_full(self.store, self._logged)
            answer = frames.SessionOpened(frame.request, False, (), frozenset(), refused=True)
        else:
            subscriptions = tuple(opened.subscriptions.items())
            options = tuple(opened.options.items())
            answer = frames.SessionOpened(
                frame.request, opened.present, subscriptions, opened.inbound, options=options, kept=opened.kept
            )
        peer.link.send(frames.encode(answer))
        self._filters_changed()  # a session that ended meanwhile took its filters with it

    def _settle(self, peer: _Peer, request: int) -> None:
        """Probe every other worker: links deliver in order, so once each has answered,
        each has applied the filters this peer's earlier frames changed (they were sent
        to it before the probe, as those frames were applied before this one)."""
        self._probes.probe(peer, lambda requester: requester.link.send(frames.encode(frames.Settled(request))))

    def _transmit(self, delivery: Delivery | None) -> None:
        """Send a persistent session's packets to the worker that holds its connection
        (with a durable store in sync ``always``, once what they change is on disk)."""
        if delivery is None:
            return
        if self.durability is None or not self.durability.later(partial(self._send, delivery), ("always",)):
            self._send(delivery)

    def _send(self, delivery: Delivery) -> None:
        epoch = str(delivery.holder)
        for peer in list(self._peers.values()):
            if epoch.startswith(f"{peer.worker}.{peer.pid}."):
                peer.link.send(frames.encode(frames.Transmit(delivery.client_id, epoch, delivery.packets, delivery.v5)))
                return
        # Not linked now (a stall): what was sent stays unacknowledged and is resent on reconnect.

    def _online(self, event: PresenceEvent) -> None:
        claim = self.registry.online(event)
        for e in claim.emit:
            self._publish(e)
        old = claim.evict
        if old is not None and old.client_id is not None:
            holder = self._holder(old)
            winner = self.registry.get(old.client_id)
            if holder is not None and winner is not None:
                detail = f"reconnected on worker {winner.worker}"
                holder.link.send(frames.encode(frames.Evict(old.client_id, old.epoch, detail)))

    def _holder(self, event: PresenceEvent) -> _Peer | None:
        for peer in list(self._peers.values()):
            if _held_by(peer.worker, peer.pid)(event):
                return peer
        return None  # detached: the worker learns it when it resynchronises

    def _resync(self, peer: _Peer, sessions: Sequence[PresenceEvent]) -> None:
        """A worker is back after a dropped link: agree on which sessions it holds."""
        held = set()
        for event in sessions:
            assert event.client_id is not None
            held.add(event.epoch)
            record = self.registry.get(event.client_id)
            if record is None:
                self._online(event)
            elif record.epoch != event.epoch or record.status != "online":
                detail = "replaced while the worker was detached"
                peer.link.send(frames.encode(frames.Evict(event.client_id, event.epoch, detail)))
        mine = _held_by(peer.worker, peer.pid)
        now = self._clock()
        # Sessions it ended while detached whose reports were lost (resends make this rare).
        gone = self.registry.lose(
            lambda e: mine(e) and e.epoch not in held, Offline.CONNECTION_LOST, "ended while detached", now
        )
        for event in gone:
            self._publish(event)
        # Messages sent to its sessions while it was detached never reached it: send the
        # unacknowledged ones again (with DUP, which the client must accept).
        for event in sessions:
            if event.client_id is not None:
                stored = self.store.get(event.client_id)
                if stored is not None and stored.holder == event.epoch:
                    self._transmit(self.store.attach(event.client_id, event.epoch))

    # -- publishing --------------------------------------------------------------------

    def _publish(self, event: PresenceEvent) -> None:
        if self.durability is not None and self.durability.tell_later(event, partial(self._tell, event)):
            return  # told once its record is on disk
        self._tell(event)

    def _tell(self, event: PresenceEvent) -> None:
        self.published += 1
        self.recent(event)
        publish_to_sinks(self.sinks, event)
        if event.client_id is not None:
            topic, properties = self.presence_prefix + event.client_id, self.retention.presence_properties(event)
            self._spread.deliver(frames.Deliver(live_presence(topic, event, properties, self.retention.presence)))

    def _filters_changed(self) -> None:
        """Send each worker what changed in the filters held by others than it (the
        persistent sessions' included: their messages route to the authority)."""
        if self._persistent:
            self._holders.change(_SESSIONS, *self._persistent.take())
        for number, added, removed in self._holders.taken():
            peer = self._peers.get(number)
            if peer is not None:
                peer.link.send(frames.encode(frames.RemoteFiltersChanged(added, removed)))

    def _check_drained(self) -> None:
        peers = [p for p in list(self._peers.values()) if p.worker >= 0]
        if peers and all(p.drained for p in peers):
            line = frames.encode(frames.CloseSubscribers())
            for peer in peers:
                peer.link.send(line)
                peer.drained = False
