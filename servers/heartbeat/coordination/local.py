"""A supervised worker's coordinator: reports go to the supervisor's authority.

The worker never waits on the authority to serve its devices: reports are queued
and written by a task of their own. Numbered frames (a session starting or ending,
a persistent session's report, a retained message, a QoS 1 or 2 message routed to
other workers) are kept until acknowledged, and sent again after a reconnection, so
a link dropped while the worker was stalled loses none; the authority applies each
number of this worker's once, so one sent twice counts once. A message's PUBACK
goes to its publisher before the authority has it: the promise is that it is not
lost while this worker lives. After a reconnection the worker also sends its
filters and the sessions it holds, and the authority evicts any that were replaced
in the meantime.

If the supervisor itself is gone (the link ends and the parent process is no
longer ours, or nothing answers for a few seconds), the worker carries on alone:
its own reports are published locally, to its sinks and its subscribers, and its
unacknowledged ones too, so a device's offline event is not lost with the
supervisor. The kernel's parent-death signal then shuts the worker down.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ...prometheus import Metric
from ..broker.reports import Discard, Opened, Report
from ..broker.topics import FilterIndex
from ..mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ..mqtt.publication import Publication
from ..presence.event import PresenceEvent, PresenceSink
from . import Coordinator, Health, Host, frames, publish_to_sinks
from .alone import Alone
from .bus_figures import bus_figures
from .durable.wills import HeldWill
from .retention import RetainedMessage
from .sys_figures import BrokerCounts

__all__ = ["BusCoordinator"]

logger = logging.getLogger("servers.heartbeat.local")

_BEHIND = 2.0  # seconds an unacknowledged report may wait before /healthz says degraded
# Routed message bytes kept for resending, at most: past it (the supervisor stalled
# under a flood), messages go unnumbered, as QoS 0 ones do, rather than grow the worker.
MAX_UNACKED_ROUTED_BYTES = 64 * 1024 * 1024
_ORPHAN_AFTER = 5.0  # seconds of failed reconnections after which the supervisor is presumed gone


@dataclass
class _Lookup:
    """A question to the authority, waiting for its answer."""

    done: trio.Event = field(default_factory=trio.Event)
    answer: frames.Frame | None = None


class BusCoordinator(Coordinator):
    """Reports to the authority at the Unix socket ``path``; see the module's docstring."""

    def __init__(
        self,
        path: str,
        *,
        worker: int,
        supervisor_pid: int | None = None,
        sinks: Sequence[PresenceSink] = (),
        presence_prefix: str = DEFAULT_PRESENCE_PREFIX,
        lookup_timeout: float = 1.0,
        durable: bool = False,
        keeps_wills: bool = False,
    ) -> None:
        self.path = path
        self.durable = durable
        """The supervisor keeps the box's state durably in sync ``always``: see :meth:`committed`."""
        self.keeps_wills = keeps_wills
        """The supervisor keeps the box's state durably (delayed Wills too; alone, see :mod:`.alone`)."""
        self._acked_seq = 0
        self._ack_durable = True
        self.worker = worker
        self.supervisor_pid = supervisor_pid
        self.sinks = list(sinks)
        """Used only once the supervisor is gone: until then the authority writes the log."""
        self.presence_prefix = presence_prefix
        self.lookup_timeout = lookup_timeout
        self._host: Host | None = None
        self._seq = 0
        self._unacked: collections.deque[tuple[int, frames.Frame, float]] = collections.deque()
        self._out: list[bytes] = []
        self._wake = trio.Event()
        self._remote = FilterIndex()
        """The other workers' filters: whole on each (re)connection, then changed by each
        RemoteFiltersChanged frame."""
        self._lookups: dict[int, _Lookup] = {}
        self._requests = itertools.count(1)
        self._acked = trio.Event()
        self._close_subscribers = trio.Event()
        self.connected = False
        self.orphaned = False
        self._alone: Alone | None = None
        self._incarnation = secrets.token_hex(8)
        self._unacked_bytes = 0
        """Payload bytes of the routed messages in ``_unacked``."""
        self.reconnects = 0
        self.resent = 0
        self.routed = 0
        self.routed_unkept = 0
        """QoS 1 and 2 messages routed without being kept for a resend (the bound was reached)."""

    # -- reports (synchronous: queued) ---------------------------------------------

    def online(self, event: PresenceEvent) -> None:
        """See :meth:`Coordinator.online`."""
        self._numbered(frames.Claimed(self._next(), event))

    def offline(self, event: PresenceEvent, *, forget: bool = False) -> None:
        """See :meth:`Coordinator.offline`."""
        self._numbered(frames.Ended(self._next(), event, forget))

    def note(self, event: PresenceEvent) -> None:
        """See :meth:`Coordinator.note`."""
        if self.orphaned:
            publish_to_sinks(self.sinks, event)
        else:
            self._send(frames.Noted(event))

    def route(self, message: Publication, groups: Sequence[str] = (), *, origin: str = "") -> Sequence[str]:
        """Sent only if another worker's subscribers hold a matching filter. A shared
        subscription held here and nowhere else is served here; one held elsewhere too
        is left to the supervisor, which picks one worker holding it."""
        remote = self._remote
        if self.orphaned or not remote:
            return groups
        mine = [group for group in groups if group not in remote] if groups else groups
        if remote.matches(message.topic):
            self.routed += 1
            if message.qos and self._keep_routed(len(message.payload)):
                self._numbered(frames.Routed(self._next(), message, origin))
                return mine
            if message.qos:
                self.routed_unkept += 1
            self._send(frames.Routed(0, message))
        return mine

    def pass_on(self, message: Publication, group: str) -> bool:
        """See :meth:`Coordinator.pass_on`: numbered, for the supervisor to pick a worker
        holding the group."""
        remote = self._remote
        if self.orphaned or not remote or group not in remote:
            return False
        if not self._keep_routed(len(message.payload)):
            return False
        self._numbered(frames.Routed(self._next(), message, group=group))
        return True

    def _keep_routed(self, size: int) -> bool:
        """Whether a routed message of ``size`` bytes may be kept for resending (its
        bytes are then counted until the supervisor acknowledges it)."""
        if self._unacked_bytes + size > MAX_UNACKED_ROUTED_BYTES:
            return False
        self._unacked_bytes += size
        return True

    def filters_changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        """See :meth:`Coordinator.filters_changed`. Unlinked, the change is dropped: the
        whole set goes on the next link (:meth:`_greet`)."""
        self._send(frames.FiltersChanged(frozenset(added), frozenset(removed)))

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def discard_session(self, client_id: str) -> None:
        """See :meth:`Coordinator.discard_session`."""
        self.session(Discard(client_id))

    def session(self, report: Report) -> None:
        """Numbered like a session's start or end: resent until the authority has it."""
        if not self.orphaned:
            self._numbered(frames.Reported(self._next(), report))

    def retain(self, topic: str, payload: bytes, qos: int, owner: str = "", properties: bytes = b"") -> None:
        """See :meth:`Coordinator.retain`; numbered too."""
        if not self.orphaned:
            self._numbered(frames.Kept(self._next(), topic, payload, qos, owner, properties))

    async def open_session(
        self,
        client_id: str,
        username: str | None = None,
        v5: bool = False,
        *,
        expiry: int | None = None,
        create: bool = True,
    ) -> Opened | None:
        """Asks the authority; None if it does not answer in time (the CONNECT is then
        refused as server-unavailable: a new session would lose the stored one)."""
        if self.orphaned:
            return Opened(False, {}, frozenset(), kept=False)  # the supervisor, and its sessions, are gone
        answer = await self._ask(lambda request: frames.OpenSession(request, client_id, username, v5, expiry, create))
        if not isinstance(answer, frames.SessionOpened) or answer.refused:
            return None
        return Opened(answer.present, dict(answer.subscriptions), answer.inbound, dict(answer.options), answer.kept)

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """A page from the authority (none if it does not answer in time)."""
        if self.orphaned:
            return [], None
        answer = await self._ask(lambda request: frames.RetainedQuery(request, topic_filter, cursor))
        if not isinstance(answer, frames.RetainedPage):
            return [], None
        return answer.messages, answer.cursor

    def will_held(self, held: HeldWill) -> None:
        """See :meth:`Coordinator.will_held`: numbered, for the supervisor's durable store."""
        if self.keeps_wills and not self.orphaned:
            self._numbered(frames.WillHeld(self._next(), held))

    def will_done(self, client_id: str, epoch: str) -> None:
        """See :meth:`Coordinator.will_done`."""
        if self.keeps_wills and not self.orphaned:
            self._numbered(frames.WillDone(self._next(), client_id, epoch))

    async def pending_wills(self) -> list[HeldWill]:
        """See :meth:`Coordinator.pending_wills`: asks the authority (worker 0 gets them)."""
        if not self.keeps_wills or self.orphaned:
            return []
        answer = await self._ask(frames.WillsQuery)
        return list(answer.wills) if isinstance(answer, frames.WillsFound) else []

    def _numbered(self, frame: frames.Numbered) -> None:
        if self.orphaned:
            if self._alone is not None and isinstance(frame, frames.Claimed | frames.Ended):
                self._alone.apply(frame)
            return
        self._unacked.append((frame.seq, frame, time.monotonic()))
        self._send(frame)

    def _send(self, frame: frames.Frame) -> None:
        if self.connected:
            self._out.append(frames.encode(frame))
            self._wake.set()

    # -- queries -----------------------------------------------------------------------

    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """Asks the authority (None if it does not answer within ``lookup_timeout``)."""
        if self._alone is not None:
            return self._alone.registry.get(client_id)
        answer = await self._ask(lambda request: frames.Lookup(request, client_id))
        return answer.event if isinstance(answer, frames.Found) else None

    async def overview(self, query: str = "", limit: int = 100) -> dict[str, Any] | None:
        """Asks the authority, which holds the box's registry (None if it does not answer
        within ``lookup_timeout``, or is gone)."""
        answer = await self._ask(lambda request: frames.Overview(request, query, limit))
        if not isinstance(answer, frames.OverviewFound):
            return None
        body: dict[str, Any] = json.loads(answer.body)
        return body

    async def broker_counts(self, own: BrokerCounts) -> BrokerCounts:
        """The box's totals, from the authority (``own`` if it does not answer in time)."""
        answer = await self._ask(lambda request: frames.BoxFigures(request, own.values()))
        return BrokerCounts.from_values(answer.values) if isinstance(answer, frames.BoxFigures) else own

    def settles(self) -> bool:
        """See :meth:`Coordinator.settles`: while linked to the supervisor."""
        return self._alone is None and self.connected

    async def settle(self) -> bool:
        """See :meth:`Coordinator.settle`: asks the authority, which probes every other
        worker; False after ``lookup_timeout`` (a stalled worker holds it up)."""
        if not self.settles():
            return True
        return isinstance(await self._ask(frames.Settle), frames.Settled)

    async def _ask(self, question: Callable[[int], frames.Frame]) -> frames.Frame | None:
        """Send a numbered question and wait up to ``lookup_timeout`` for its answer."""
        if not self.connected:
            return None
        request = next(self._requests)
        pending = self._lookups[request] = _Lookup()
        self._send(question(request))
        with trio.move_on_after(self.lookup_timeout):
            await pending.done.wait()
        del self._lookups[request]
        return pending.answer

    async def flush(self) -> None:
        """Wait until every report is acknowledged (or the supervisor is gone)."""
        while self._unacked and not self.orphaned:
            if self._acked.is_set():
                self._acked = trio.Event()
            await self._acked.wait()

    def commit_mark(self) -> int | None:
        """See :meth:`Coordinator.commit_mark`: the last numbered frame, while unacknowledged."""
        if not self.durable or self.orphaned or not self._unacked:
            return None
        return self._seq

    async def committed(self, mark: int) -> bool:
        """See :meth:`Coordinator.committed`: the authority acknowledges after its commit
        (False if that commit failed, or the supervisor is gone)."""
        while self._acked_seq < mark:
            if self.orphaned:
                return False
            if self._acked.is_set():
                self._acked = trio.Event()
            await self._acked.wait()
        return self._ack_durable

    async def drain(self) -> None:
        """Wait until every report is acknowledged, then until every worker has drained."""
        await self.flush()
        if self.orphaned:
            return
        self._send(frames.Drained())
        await self._close_subscribers.wait()

    def health(self) -> Health:
        """Degraded while the link is down or reports wait unacknowledged."""
        if self.orphaned:
            return Health(False, "the supervisor is gone")
        if not self.connected:
            return Health(False, "not connected to the supervisor")
        if not self._ack_durable:
            return Health(False, "the durable store cannot write (the supervisor's log says why)")
        if self._unacked and time.monotonic() - self._unacked[0][2] > _BEHIND:
            age = time.monotonic() - self._unacked[0][2]
            return Health(False, f"{len(self._unacked)} reports unacknowledged for {age:.1f} s")
        return Health(True)

    def figures(self) -> list[Metric]:
        """Link state and traffic (:func:`.bus_figures.bus_figures`)."""
        return bus_figures(self)

    # -- the link ----------------------------------------------------------------------

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the link up (reconnecting) until cancelled, or until the supervisor is gone."""
        self._host = host
        first = True
        failing_since: float | None = None
        delay = 0.05
        while not self.orphaned:
            try:
                stream = await trio.open_unix_socket(self.path)
            except OSError:
                stream = None
            if stream is None:
                now = time.monotonic()
                failing_since = failing_since or now
                if self._supervisor_gone() or now - failing_since > _ORPHAN_AFTER:
                    self._orphan()
                    break
                if first:
                    first = False
                    task_status.started()
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            failing_since, delay = None, 0.05
            async with stream:
                self._greet(reconnect=not first)
                if first:
                    first = False
                    task_status.started()
                else:
                    self.reconnects += 1
                await self._serve(stream)
            self.connected = False
            if self._supervisor_gone():
                self._orphan()
        if first:
            task_status.started()
        await trio.sleep_forever()

    def _supervisor_gone(self) -> bool:
        return self.supervisor_pid is not None and os.getppid() != self.supervisor_pid

    def _greet(self, reconnect: bool) -> None:
        assert self._host is not None
        self.connected = True
        self._out = []
        self._send(frames.Hello(self.worker, os.getpid(), self._incarnation))
        for _seq, frame, _t in self._unacked:
            self._send(frame)
            self.resent += 1
        if reconnect:
            self._send(frames.Filters(frozenset(self._host.filters())))
            self._send(frames.Resync(tuple(self._host.sessions())))

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, stream)
            buf = b""
            try:
                async for data in stream:
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line:
                            self._received(line)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

    async def _writer(self, stream: trio.SocketStream) -> None:
        try:
            while True:
                if not self._out:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                batch, self._out = self._out, []
                await stream.send_all(b"".join(batch))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader sees the end too and reconnects

    def _received(self, line: bytes) -> None:
        try:
            frame = frames.decode(line)
        except frames.FrameError as exc:
            logger.warning("bus: bad frame from the authority, ignored: %s", exc)
            return
        host = self._host
        assert host is not None
        if isinstance(frame, frames.Deliver):
            # A shared subscription's copy, if the supervisor picked this worker for it;
            # else the other subscribers only (whoever published served its own groups).
            group = frame.group
            groups = (group,) if group else ()
            host.deliver(frame.message, groups, not group)
        elif isinstance(frame, frames.Ack):
            self._acked_seq, self._ack_durable = frame.seq, frame.durable
            unacked = self._unacked
            while unacked and unacked[0][0] <= frame.seq:
                done = unacked.popleft()[1]
                if isinstance(done, frames.Routed):
                    self._unacked_bytes -= len(done.message.payload)
            self._acked.set()
        elif isinstance(frame, frames.Evict):
            host.evict(frame.client_id, frame.epoch, frame.detail)
        elif isinstance(frame, frames.RemoteFiltersChanged):
            self._remote.update(frame.added, frame.removed)
        elif isinstance(frame, frames.RemoteFilters):
            self._remote.replace(frame.filters)
        elif isinstance(frame, frames.Transmit):
            host.transmit(frame.client_id, frame.epoch, frame.packets, frame.v5)
        elif isinstance(frame, frames.Probe):
            self._send(frames.Probed(frame.token))
        elif isinstance(
            frame,
            frames.Found | frames.SessionOpened | frames.RetainedPage | frames.Settled | frames.OverviewFound
            | frames.WillsFound | frames.BoxFigures,
        ):  # fmt: skip
            pending = self._lookups.get(frame.request)
            if pending is not None:
                pending.answer = frame
                pending.done.set()
        elif isinstance(frame, frames.CloseSubscribers):
            self._close_subscribers.set()

    # -- alone ---------------------------------------------------------------------------

    def _orphan(self) -> None:
        """The supervisor is gone: publish this worker's own reports from now on."""
        if self.orphaned:
            return
        logger.warning("bus: the supervisor is gone; worker %d publishes its own presence events", self.worker)
        self.orphaned = True
        self.connected = False
        self._alone = Alone(self.sinks, lambda: self._host, self.presence_prefix, self.keeps_wills)
        pending, self._unacked = list(self._unacked), collections.deque()
        self._unacked_bytes = 0
        for _seq, frame, _t in pending:
            if isinstance(frame, frames.Claimed | frames.Ended):
                self._alone.apply(frame)
        self._acked.set()
        self._close_subscribers.set()
        for question in self._lookups.values():
            question.done.set()
