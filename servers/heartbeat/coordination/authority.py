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

import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ...bus import Link
from ...logs import OncePer
from ..broker.reports import Attach, Delivery
from ..broker.topics import FilterIndex
from ..mqtt.endings import Offline
from ..mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ..mqtt.publication import Publication
from ..presence.event import PresenceEvent, PresenceSink
from ..presence.overview import RecentEnds, registry_overview
from . import frames, log_session_drops, log_sessions_full, publish_to_sinks
from .holders import Holders
from .registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .registry import Registry
from .retention import MqttState

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
class _Settling:
    """Probes out: the links whose :class:`Probed` is awaited, and what to do then (answer
    a :class:`Settle`, or an :class:`OpenSession` that had to wait)."""

    requester: int
    waiting: set[int]
    then: Callable[[_Peer], None]


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
        self._turns: dict[str, int] = {}
        """Whose turn it is, per shared subscription held on several workers."""
        self._holders: Holders[int] = Holders()
        """Every link's filters and the persistent sessions', and what each worker routes by."""
        self._persistent = self.store.subscriptions.track()
        self._holders.change(_SESSIONS, *self._persistent.take())
        self._workers: dict[int, int] = {}  # pid -> worker index, for every pid that said hello
        # The highest number applied from each worker process's coordinator (its
        # incarnation): a frame resent after a dropped link is acknowledged, not applied again.
        self._applied: dict[str, int] = {}
        self._incarnations: dict[int, set[str]] = {}  # pid -> its incarnations, forgotten when it exits
        self._settling: dict[int, _Settling] = {}  # by probe token
        self._tokens = itertools.count(1)
        self.published = 0
        self.lost = 0
        self.dropped_links = 0
        self.repeats = 0
        """Numbered frames that came again after a dropped link and were not applied twice."""
        self.stale_attaches = 0
        """Persistent sessions' attaches refused: their connection had already lost the client id."""
        self.shared_lost = 0
        """Shared subscriptions' unacknowledged messages passed on with no member left to take them."""

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
        """Acknowledge every numbered report of the batch at once."""
        peer = self._peers.get(link.number)
        if peer is not None and peer.seq > peer.acked:
            peer.acked = peer.seq
            link.send(frames.encode(frames.Ack(peer.seq)))

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
        self._filters_changed()
        self._check_drained()
        for token, settling in list(self._settling.items()):
            if settling.requester == link.number:
                del self._settling[token]
            else:
                self._probe_answered(token, link.number)  # a gone worker routes nothing

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
        """Every session worker ``worker`` (process ``pid``) held goes offline, ``worker-lost``."""
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
        seq = (
            frame.seq
            if isinstance(frame, frames.Reported | frames.Kept | frames.Claimed | frames.Ended | frames.Routed)
            else 0
        )
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
                self._probe(peer, lambda requester: self._open(requester, frame))
            else:
                self._open(peer, frame)
        elif isinstance(frame, frames.RetainedQuery):
            messages, cursor = self.retention.page(frame.topic_filter, frame.cursor)
            peer.link.send(frames.encode(frames.RetainedPage(frame.request, messages, cursor)))
        elif isinstance(frame, frames.Claimed):
            self._online(frame.event)
        elif isinstance(frame, frames.Ended):
            if self.registry.offline(frame.event, forget=frame.forget) is not None:
                self._publish(frame.event)
        elif isinstance(frame, frames.Routed) and frame.group:
            self._pass_on(frames.Deliver(frame.message, frame.group), skip=peer)
        elif isinstance(frame, frames.Routed):
            self._deliver(frames.Deliver(frame.message), skip=peer)
            for delivery in self.store.route(frame.message, frame.origin):
                self._transmit(delivery)
            log_session_drops(self.store)
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
            self._probe_answered(frame.token, peer.link.number)
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
        self._probe(peer, lambda requester: requester.link.send(frames.encode(frames.Settled(request))))

    def _probe(self, peer: _Peer, then: Callable[[_Peer], None]) -> None:
        """Probe every worker but ``peer``'s; ``then(peer)`` once all have answered."""
        others = [p for p in self._peers.values() if p is not peer and p.worker >= 0]
        token = next(self._tokens)
        self._settling[token] = _Settling(peer.link.number, {p.link.number for p in others}, then)
        if not others:
            self._settled(token)
            return
        line = frames.encode(frames.Probe(token))
        for other in others:
            other.link.send(line)

    def _probe_answered(self, token: int, number: int) -> None:
        settling = self._settling.get(token)
        if settling is not None:
            settling.waiting.discard(number)
            if not settling.waiting:
                self._settled(token)

    def _settled(self, token: int) -> None:
        settling = self._settling.pop(token)
        requester = self._peers.get(settling.requester)
        if requester is not None:
            settling.then(requester)

    def _transmit(self, delivery: Delivery | None) -> None:
        """Send a persistent session's packets to the worker that holds its connection."""
        if delivery is None:
            return
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
        self.published += 1
        self.recent(event)
        publish_to_sinks(self.sinks, event)
        if event.client_id is not None:
            topic, properties = self.presence_prefix + event.client_id, self.retention.presence_properties(event)
            self._deliver(frames.Deliver(Publication(topic, event.payload(), 0, False, properties)))

    def _deliver(self, frame: frames.Deliver, skip: _Peer | None = None) -> None:
        """``frame`` to every worker with a matching subscriber but ``skip`` (the one that
        published it); and, for each shared subscription the topic reaches, to one of
        the workers holding it, in turn (not at all if only ``skip`` holds it: it served
        it itself)."""
        line = b""
        topic = frame.message.topic
        holders: dict[str, list[_Peer]] = {}
        for peer in list(self._peers.values()):
            index = peer.index
            if not index:
                continue
            if peer is not skip and index.matches_plain(topic):
                line = line or frames.encode(frame)
                peer.link.send(line)
            if index.shared:
                for group in index.shared.matching(topic):
                    holders.setdefault(group, []).append(peer)
        for group, peers in holders.items():
            if peers == [skip]:
                continue
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            peers[turn % len(peers)].link.send(frames.encode(replace(frame, group=group)))

    def _pass_on(self, frame: frames.Deliver, skip: _Peer) -> None:
        """A shared subscription's message a member of ``skip`` left unacknowledged: to
        another worker holding the group, in turn (lost if none does now)."""
        topic = frame.message.topic
        peers = [
            p
            for p in list(self._peers.values())
            if p is not skip and p.index and p.index.shared and frame.group in p.index.shared.matching(topic)
        ]
        if not peers:
            self.shared_lost += 1
            return
        turn = self._turns.get(frame.group, 0)
        self._turns[frame.group] = turn + 1
        peers[turn % len(peers)].link.send(frames.encode(frame))

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
