"""``$SYS/broker/...``: the broker statistics Mosquitto publishes, with its topic names,
payload formats and timing, for the dashboards that read them (MQTT Explorer,
Telegraf's mqtt_consumer, Node-RED).

Every ``--sys-interval`` seconds a worker samples its counts (:func:`sample`), its
coordinator completes them (the persistent sessions and retained messages; a box's
totals over its workers: :mod:`..coordination.sys_figures`), and :class:`SysTree` (no
I/O) says which topics to publish: as Mosquitto 2.0 does, ``uptime`` every time and
every other value only when it changed; the load averages every time the first time,
then when they moved by 0.01 or more. They go to this worker's subscribers only, never
to the retained store (so neither to the durable file nor to a fleet's Redis); a new
subscription to a filter that matches them is sent the current values, retained, as
Mosquitto's retained store would. See ``docs/reference/sys-topics.md``.
"""

from __future__ import annotations

import collections
import math
import os
import resource
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio

import idlekeeper

from ..coordination.sys_figures import BrokerCounts
from ..mqtt.filters import topic_matches
from ..mqtt.publication import Publication

if TYPE_CHECKING:
    from .lifecycle import HeartbeatServer

__all__ = ["LOAD_KINDS", "PREFIX", "VERSION", "SysTree", "count_out", "publish_sys_tree", "resident_bytes", "sample"]

PREFIX = "$SYS/broker/"
VERSION = f"idlekeeper version {idlekeeper.__version__}"
"""The payload of ``$SYS/broker/version`` (Mosquitto's: ``mosquitto version 2.0.11``)."""

LOAD_KINDS: tuple[tuple[str, str], ...] = (
    ("messages/received", "messages_received"),
    ("messages/sent", "messages_sent"),
    ("publish/dropped", "publish_dropped"),
    ("publish/received", "publish_received"),
    ("publish/sent", "publish_sent"),
    ("bytes/received", "bytes_received"),
    ("bytes/sent", "bytes_sent"),
    ("sockets", "sockets"),
    ("connections", "connects"),
)
"""Each ``load/<kind>/<window>`` topic and the count whose rate it averages, in Mosquitto's order."""

_WINDOWS = (("1min", 60.0), ("5min", 300.0), ("15min", 900.0))

# The totals after the loads, each under its topic, in the order Mosquitto sends them.
_TOTALS: tuple[tuple[str, str], ...] = (
    ("subscriptions/count", "subscriptions"),
    ("shared_subscriptions/count", "shared_subscriptions"),
    ("retained messages/count", "retained"),
    ("heap/current", "heap_current"),
    ("heap/maximum", "heap_maximum"),
    ("messages/received", "messages_received"),
    ("messages/sent", "messages_sent"),
    ("publish/messages/dropped", "publish_dropped"),
    ("publish/messages/received", "publish_received"),
    ("publish/messages/sent", "publish_sent"),
    ("bytes/received", "bytes_received"),
    ("bytes/sent", "bytes_sent"),
    ("publish/bytes/received", "publish_bytes_received"),
    ("publish/bytes/sent", "publish_bytes_sent"),
)


class SysTree:
    """The ``$SYS/broker`` values and what changed since the last :meth:`update` (no I/O).

    ``start`` is when the broker started, on the clock :meth:`update` is given.
    """

    def __init__(self, start: float, version: str = VERSION) -> None:
        self.start = start
        self.current: dict[str, bytes] = {PREFIX + "version": version.encode()}
        """Every topic's last value, as a new subscriber is sent it (retained)."""
        self._last: BrokerCounts | None = None
        self._last_time = start
        self._loads: dict[str, float] = {}
        self._maximum = 0

    def update(self, counts: BrokerCounts, now: float) -> list[tuple[str, bytes]]:
        """The topics to publish for ``counts`` sampled at ``now``, with their payloads, in
        Mosquitto's order; :attr:`current` takes them."""
        out: list[tuple[str, bytes]] = []
        put = self._put
        put(out, "uptime", f"{int(now - self.start)} seconds", always=True)
        total = counts.connected + counts.away
        if total > self._maximum:
            self._maximum = total
            maximum_changed = True
        else:
            maximum_changed = False
        put(out, "clients/total", total)
        if maximum_changed:
            put(out, "clients/maximum", self._maximum)
        # The deprecated names first, as Mosquitto sends them, each with its new twin.
        put(out, "clients/inactive", counts.away)
        put(out, "clients/disconnected", counts.away)
        put(out, "clients/active", counts.connected)
        put(out, "clients/connected", counts.connected)
        put(out, "clients/expired", counts.expired)
        self._load(out, counts, now)
        # Mosquitto's store holds its own $SYS values too, and counts them: so do these.
        own, own_bytes = len(self.current), sum(map(len, self.current.values()))
        put(out, "messages/stored", counts.stored + own)
        put(out, "store/messages/count", counts.stored + own)
        put(out, "store/messages/bytes", counts.stored_bytes + own_bytes)
        for topic, name in _TOTALS:
            put(out, topic, getattr(counts, name) + (own if name == "retained" else 0))
        self._last, self._last_time = counts, now
        return out

    def _put(self, out: list[tuple[str, bytes]], topic: str, value: object, *, always: bool = False) -> None:
        """Publish ``value`` under ``topic`` if it changed (or ``always``)."""
        payload = str(value).encode()
        topic = PREFIX + topic
        if always or self.current.get(topic) != payload:
            self.current[topic] = payload
            out.append((topic, payload))

    def _load(self, out: list[tuple[str, bytes]], counts: BrokerCounts, now: float) -> None:
        """The moving averages of each count's rate a minute, over 1, 5 and 15 minutes.

        Mosquitto's: with ``dt`` the seconds since the last update and ``rate`` the
        count's growth over them times 60/dt, each average moves to ``rate + exp(-dt/T)
        * (average - rate)`` for a window of T seconds. The first update publishes
        every average at 0.00 and only takes the counts as the base; later ones publish
        an average when it moved by 0.01 or more since the last update (it is kept
        either way, so a slow drift is never sent)."""
        last = self._last
        if last is None:
            for window, _ in _WINDOWS:
                for kind, _ in LOAD_KINDS:
                    topic = f"{PREFIX}load/{kind}/{window}"
                    self._loads[topic] = 0.0
                    self.current[topic] = b"0.00"
                    out.append((topic, b"0.00"))
            return
        elapsed = now - self._last_time
        if elapsed <= 0:
            return
        scale = 60.0 / elapsed
        rates = [(kind, (getattr(counts, name) - getattr(last, name)) * scale) for kind, name in LOAD_KINDS]
        for window, seconds in _WINDOWS:
            decay = math.exp(-elapsed / seconds)
            for kind, rate in rates:
                topic = f"{PREFIX}load/{kind}/{window}"
                old = self._loads[topic]
                new = self._loads[topic] = rate + decay * (old - rate)
                if abs(new - old) >= 0.01:
                    payload = f"{new:.2f}".encode()
                    self.current[topic] = payload
                    out.append((topic, payload))

    def matching(self, topic_filter: str) -> Iterator[tuple[str, bytes]]:
        """The current values whose topics ``topic_filter`` matches (none for a filter
        that begins with a wildcard: MQTT keeps ``$`` topics from those)."""
        if not topic_filter.startswith("$SYS"):
            return
        for topic, payload in self.current.items():
            if topic_matches(topic_filter, topic):
                yield topic, payload


def count_out(counters: collections.Counter[str], data: bytes) -> None:
    """A packet written to a client (``data``: one, or a few the broker joined, which
    it counts itself): ``$SYS/broker/messages/sent`` and ``bytes/sent``."""
    counters["packets_out"] += 1
    counters["bytes_out"] += len(data)


def resident_bytes() -> tuple[int, int]:
    """This process's resident bytes now and at most so far (Linux's ``/proc``; 0 elsewhere).

    Mosquitto counts the bytes it allocated (``heap/current``); a Python process's
    allocations are not counted without a cost on each one, and resident memory is
    what an operator watches anyway."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            current = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        current = 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return current, max(current, peak)


def sample(server: HeartbeatServer) -> BrokerCounts:
    """This worker's own counts (what its coordinator keeps is added by it)."""
    counters = server.counters
    broker = server.broker
    engine = server.engine
    # The PINGREQs the dense engine answered itself, each a 2-byte packet in and one out.
    canned = 0 if engine is None else engine.canned
    current, peak = resident_bytes()
    return BrokerCounts(
        connected=len(server.online),
        messages_received=server.packets_in(),
        messages_sent=counters["packets_out"] + broker.joined + canned,
        publish_received=counters["messages_in"],
        publish_sent=broker.delivered,
        publish_dropped=broker.dropped,
        publish_bytes_received=counters["publish_bytes_in"],
        publish_bytes_sent=broker.delivered_bytes,
        bytes_received=counters["bytes_in"] + 2 * canned,
        bytes_sent=counters["bytes_out"] + 2 * canned,
        subscriptions=len(broker.subscriptions),
        shared_subscriptions=broker.subscriptions.shared_count(),
        heap_current=current,
        heap_maximum=peak,
        sockets=counters["connections"],
        connects=counters["connects"],
    )


async def publish_sys_tree(
    server: HeartbeatServer,
    interval: float,
    *,
    task_status: trio.TaskStatus[SysTree] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish ``$SYS/broker`` to this worker's subscribers every ``interval`` seconds
    until cancelled; a new subscription is sent the current values from the start."""
    start = trio.current_time()
    tree = SysTree(start)
    server.fanout.retained.own = tree.matching
    task_status.started(tree)
    due = start
    while True:  # the first at once, as Mosquitto's: a subscriber finds the values from the start
        counts = await server.coordinator.broker_counts(sample(server))
        for topic, payload in tree.update(counts, trio.current_time()):
            # QoS 0: each value is replaced at the next interval, and a QoS 0 copy reaches
            # every subscriber, persistent sessions' included (see the reference page).
            server.broker.deliver(Publication(topic, payload, 0, True))
        # On a fixed cadence (a slow answer from the authority does not push the next one
        # later); a worker held up longer than an interval skips rather than bursts.
        due = max(due + interval, trio.current_time())
        await trio.sleep_until(due)
