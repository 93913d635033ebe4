"""The crash drill: ``kill -9`` mid-load, restart on the same state, count what was lost.

1. Start; ``subscribers`` persistent clients (CleanSession 0) subscribe ``drill/q`` at
   QoS 1 and ``drill/e`` at QoS 2, and leave; the QoS 2 publisher opens its persistent
   session too. Stop cleanly and start again (Mosquitto saves its sessions only then,
   or at its autosave: without this it would lose the subscriptions themselves).
2. Half the subscribers come back and stay, reading (``live``); the others stay away
   (``absent``: their messages queue). ``devices`` clients connect (keep-alive 60).
3. A QoS 1 publisher (``rate`` a second) and a QoS 2 one (a quarter of that), both
   pipelining within a window, publish for ``before`` seconds; then the server's
   processes are ``kill -9``-ed together. What they acknowledged before dying is read
   to the last byte.
4. Restart on the same state; every subscriber comes back (CleanSession 0), the QoS 2
   publisher resumes its session (resending what was not PUBREC'd, PUBREL for what
   was), the devices reconnect; count until quiet.
5. Ours: stop cleanly and start once more, so the sessions the stop ended get their
   offline events (``server-shutdown``); then check every presence log together.

A message the publisher had PUBACKed (or PUBREC'd) and a subscriber never got is
lost; a QoS 2 message a subscriber got twice is a copy.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.history import HistoryReport, check_history

from .clients import Client, Publisher, Subscriber, connect_many, drive
from .targets import Target

__all__ = ["Drill", "DrillLoad", "drill_target", "run_drill"]


@dataclass(frozen=True)
class DrillLoad:
    """The drill's sizes."""

    devices: int = 5000
    subscribers: int = 4
    rate: float = 2000.0
    """QoS 1 messages a second (the QoS 2 publisher: a quarter of it)."""
    before: float = 4.0
    """Seconds of publishing before the kill."""
    window: int = 32
    limit: float = 60.0
    """Seconds the count after the restart may take at most."""
    quiet: float = 3.0
    """Seconds without a message after which the count stops before everything came."""


@dataclass
class Drill:
    """What one drill found."""

    name: str
    acked: int
    """QoS 1 messages PUBACKed before the kill."""
    acked2: int
    """QoS 2 messages PUBREC'd before the kill."""
    published2: int
    """QoS 2 messages published in all (each must arrive exactly once: those not
    PUBREC'd were resent after the restart)."""
    lost: dict[str, int]
    """Per subscriber: PUBACKed QoS 1 messages it never got."""
    lost2: dict[str, int]
    """Per subscriber: QoS 2 messages it never got (of every one published)."""
    copies2: dict[str, int]
    """Per subscriber: QoS 2 messages got more than once."""
    copies: dict[str, int]
    """Per subscriber: QoS 1 messages got more than once (allowed: at least once)."""
    reused: int
    """QoS 2 packet ids reused for another message while the subscriber still held them."""
    sessions_present: int
    """Subscribers whose session the restarted server still had."""
    restart: float
    """Seconds from the kill to listening again."""
    history: HistoryReport | None
    """Ours: every presence log checked together."""
    reasons: dict[str, int]
    """Ours: offline events by reason, over every log."""

    @property
    def total_lost(self) -> int:
        """PUBACKed QoS 1 messages lost, over every subscriber."""
        return sum(self.lost.values())

    @property
    def total_lost2(self) -> int:
        """QoS 2 messages lost, over every subscriber."""
        return sum(self.lost2.values())

    @property
    def total_copies2(self) -> int:
        """QoS 2 messages got twice, over every subscriber."""
        return sum(self.copies2.values())


def _subscribers(load: DrillLoad) -> list[Subscriber]:
    return [Subscriber(f"drill-sub-{i}") for i in range(load.subscribers)]


def _prepare(target: Target, subs: list[Subscriber], pub2: Publisher) -> None:
    target.start()
    for sub in subs:
        sub.open(target.port, clean=False)
        sub.subscribe([("drill/q", 1), ("drill/e", 2)])
        sub.leave()
    pub2.open(target.port, clean=False)
    pub2.leave()
    target.stop()


def run_drill(target: Target, load: DrillLoad) -> Drill:
    """Run the drill on ``target`` (its state in ``target.workdir``); see the module."""
    subs = _subscribers(load)
    live = subs[: max(1, len(subs) // 2)]  # the others stay away
    pub1 = Publisher("drill-pub1", "drill/q", 1, window=load.window, rate=load.rate)
    pub2 = Publisher("drill-pub2", "drill/e", 2, window=load.window, rate=load.rate / 4)
    devices = [Client(f"dev-{i:05d}") for i in range(load.devices)]
    port = target.port
    _prepare(target, subs, pub2)
    target.start()
    try:
        for sub in live:
            sub.open(port, clean=False)
        connect_many(devices, port, clean=True)
        pub1.open(port, clean=True)
        pub2.open(port, clean=False)
        drive([pub1, pub2, *live], lambda: False, load.before)
        killed = time.monotonic()
        target.kill()
        pub1.stopped = pub2.stopped = True
        drive([pub1, pub2, *live], lambda: pub1.closed and pub2.closed and all(s.closed for s in live), 10)
        for c in [pub1, pub2, *live, *devices]:
            c.close()
        acked, acked2 = set(pub1.acked), set(pub2.acked)
        target.start()
        restart = time.monotonic() - killed
        present = 0
        for sub in subs:
            sub.open(port, clean=False)
            present += sub.session_present
        pub2.open(port, clean=False)
        pub2.resume()
        connect_many(devices, port, clean=True)
        everything2 = set(range(pub2.next_seq))

        def complete() -> bool:
            return pub2.settled and all(acked <= s.seqs("drill/q") and everything2 <= s.seqs("drill/e") for s in subs)

        drive([pub2, *subs], complete, load.limit, quiet=load.quiet)
        for c in [pub2, *subs]:
            c.leave()
        target.stop()
        if target.mode != "mosquitto":
            target.start()  # the sessions the stop ended get their offline events
            target.stop()
    finally:
        for c in [pub1, pub2, *subs, *devices]:
            c.close()
        target.stop()
    history, reasons = None, collections.Counter[str]()
    if target.mode != "mosquitto":
        events = []
        for start in range(target.starts):
            path = target.presence_log(start)
            if path.exists():
                events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        history = check_history(events)
        reasons.update(e["reason"] for e in events if e.get("status") == "offline")
    return Drill(
        target.name,
        len(acked),
        len(acked2),
        len(everything2),
        {s.client_id: len(acked - s.seqs("drill/q")) for s in subs},
        {s.client_id: len(everything2 - s.seqs("drill/e")) for s in subs},
        {s.client_id: s.copies("drill/e") for s in subs},
        {s.client_id: s.copies("drill/q") for s in subs},
        sum(s.reused for s in subs),
        present,
        restart,
        history,
        dict(reasons),
    )


def drill_target(mode: str, port: int, workdir: Path, load: DrillLoad, workers: int = 2) -> Target:
    """The drill's target: ours with ``--workers``, a presence log a start, queues that
    hold the whole run."""
    directory = workdir / f"drill-{mode}-{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    queue = int(load.rate * (load.before + 5)) + 10_000
    return Target(mode, port, directory, workers=1 if mode == "mosquitto" else workers, max_queued=queue,
                  presence=True)  # fmt: skip
