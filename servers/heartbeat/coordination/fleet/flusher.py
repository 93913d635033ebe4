"""Applying a fleet node's queued reports to Redis, in order: batches in one round trip
each, every report's script calls and what their replies mean, and the
resynchronisation when one is due.

A report is taken off the queue only once its batch was answered: one whose reply
was lost is sent again, which the scripts make harmless (compare-and-set on the epoch).
A report that a script fails on (an error raised inside Redis's Lua, which would fail
the same way however often it was sent) is logged, counted and dropped, rather than
retried for ever with every report behind it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import coredis
import trio

from .. import Host
from .claims import Claims
from .link import RedisLink
from .queue import Queued, ReportQueue, Request
from .retained import FleetRetained
from .routes import Routes
from .sessions import PersistentSessions

__all__ = ["FLUSH_BATCH", "Flusher", "script_fault"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")

FLUSH_BATCH = 256
"""Reports in flight at once: applied concurrently, each device's (and the routes) in order."""


def script_fault(exc: Exception) -> bool:
    """Whether ``exc`` is an error raised inside a script (Redis names the script's
    code ``user_script`` in it): the same call would fail again, unlike a connection
    lost, a failover's READONLY, or NOSCRIPT."""
    return isinstance(exc, coredis.exceptions.ResponseError) and "user_script" in str(exc)


class Flusher:
    """The task that empties the report queue into Redis."""

    def __init__(
        self,
        link: RedisLink,
        queue: ReportQueue,
        claims: Claims,
        routes: Routes,
        sessions: PersistentSessions,
        retained: FleetRetained,
        *,
        reader_ready: trio.Event,
        moved_on: Callable[[], None],
        extend_lease: Callable[[Any], Any] | None = None,
    ) -> None:
        self.link = link
        self.queue = queue
        self.claims = claims
        self.routes = routes
        self.sessions = sessions
        self.retained = retained
        self.reader_ready = reader_ready
        self.moved_on = moved_on
        self.extend_lease = extend_lease
        """Queues this node's lease, extended if it still holds it, in a pipeline: a node
        whose reports reach Redis is alive, however late its renewer task runs."""

    async def run(self, host: Host) -> None:
        """Apply the queue's reports for ``host`` until cancelled, retrying after failures."""
        await self.reader_ready.wait()  # events this node emits must not precede the reader's start
        queue = self.queue
        attempt = 0
        while True:
            if not queue.items and not queue.resync:
                queue.queued_since = None
                await queue.wait()
                continue
            try:
                if queue.resync:
                    await self.claims.resynchronise(host, queue, self.sessions)
                else:
                    queue.busy = True
                    batch: list[Queued] = []
                    two_steps = self.routes.two_steps
                    for report in itertools.islice(queue.items, FLUSH_BATCH):
                        if two_steps(report):
                            # Its second step depends on the first's answer: it goes alone.
                            batch = batch or [report]
                            break
                        batch.append(report)
                    await self._apply_batch(host, batch)
                    # Only now are they taken off: see the module's docstring.
                    for _ in batch:
                        queue.items.popleft()
                    queue.applied += len(batch)
                    queue.busy = False
                    queue.queued_since = time.monotonic() if queue.items else None
                attempt = 0
            except (Exception, trio.TooSlowError) as exc:
                queue.busy = False
                attempt += 1
                await self.link.failed_attempt(exc, attempt)
            self.moved_on()

    async def _apply_batch(self, host: Host, batch: list[Queued]) -> None:
        """Apply reports in order, in one round trip (a pipeline of script calls).

        One call at a time capped a node at one report per round trip plus coredis's
        per-call work (about 2,000 a second here): at 10,000 devices per gateway the
        presence feed fell tens of seconds behind. A pipeline keeps the order (Redis
        runs its commands in sequence) at several times the rate.
        """
        if len(batch) == 1:
            await self._apply_or_drop(host, batch[0])
            return
        try:
            redis = self.link.redis()
            started = time.perf_counter()
            pending: list[Request] = []
            with trio.fail_after(self.link.timeout * 2):
                async with redis.pipeline(transaction=False) as pipe:
                    for report in batch:
                        pending += self._request(host, report, pipe)
                    if self.extend_lease is not None:
                        # Measured: 200 sessions swept `node-lost` from workers alive but
                        # draining 10,000 offlines each, whose renewals came too late.
                        self.extend_lease(pipe)
                for request, done in pending:
                    done(await request)
            self.link.ok(started)
        except coredis.exceptions.ResponseError as exc:
            noscript = isinstance(exc, coredis.exceptions.NoScriptError) or "NOSCRIPT" in str(exc)
            if not noscript and not script_fault(exc):
                raise
            # Redis restarted (or failed over) and lacks the scripts, and plain calls load
            # them again; or a script failed on one report, which alone is dropped. What
            # the pipeline did apply is applied again, harmlessly (see above).
            for report in batch:
                await self._apply_or_drop(host, report)

    async def _apply_or_drop(self, host: Host, report: Queued) -> None:
        try:
            await self._apply(host, report)
        except coredis.exceptions.ResponseError as exc:
            if not script_fault(exc):
                raise
            self.sessions.counts.failed += 1
            what = report.report or report.question or report.event or report.topic
            logger.error(
                "node %s: Redis's script failed on a %s report, dropped: %s (%r)",
                self.sessions.node,
                report.kind,
                exc,
                what,
            )

    async def _apply(self, host: Host, report: Queued) -> None:
        for request, done in self._request(host, report, self.link.redis()):
            done(await self.link.call(request))
        if self.routes.two_steps(report):
            await self.routes.route_checked(report)

    def _request(self, host: Host, report: Queued, client: Any) -> list[Request]:
        """The script calls that apply ``report`` (on ``client``: a connection or a pipeline),
        each with what to do with its reply; none if there is nothing to send."""
        kind = report.kind
        if kind == "route":
            return self.routes.requests(report, client)
        if kind == "session":
            assert report.report is not None
            return self.sessions.request(report.report, client)
        if kind == "open":
            assert report.question is not None
            return self.sessions.open_request(report.question, client)
        if kind == "retain":
            return [
                self.retained.request(report.topic, report.payload, report.qos, report.owner, client, report.properties)
            ]
        event = report.event
        assert event is not None and event.client_id is not None
        claims = self.claims
        if kind == "online":
            client_id = event.client_id

            def claimed(out: Any) -> None:
                if not claims.claimed(out, client_id):
                    # It crossed a newer session's claim from another node: that one holds the device.
                    host.evict(client_id, event.epoch, "a newer session holds this client id")

            return [(claims.claim_request(event, "claim", client), claimed)]
        client_id = event.client_id
        return [(claims.offline_request(event, report.forget, client), lambda out: claims.offline_done(out, client_id))]
