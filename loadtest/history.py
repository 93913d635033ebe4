"""A presence history, checked whole and per device, in the spirit of Jepsen's checkers.

Presence promises one online event and one offline event per session (an accepted
CONNECT, named by its fleet-wide unique ``epoch``), and a device online in at most one
session at a time, give or take the lease a fleet allows a lost node. Fault runs
(a killed worker or gateway, Redis restarted empty, a partition) can break that in
ways a count of lost and duplicated events does not see: an end that comes before
its start, two sessions of one device both online for minutes. :func:`check_history`
reads every event a run saw, in the order a reader saw them, and names each
violation with the device and session it concerns:

``no-start``
    an offline event for a session whose online event never came;
``no-end``
    a session that came online and never ended (only for a history that is
    complete: the servers stopped before it was read);
``duplicate-start``
    a session announced twice in one run of its store (an empty Redis restart makes
    every node announce its sessions again: each event carries the ``incarnation``
    of the store it was read from, and only two in one incarnation are a duplicate;
    a gateway's log has no incarnations, and with ``reannounced_copies`` an online
    event repeated word for word is taken for such an announcement, counted apart);
``duplicate-end``
    a session ended twice;
``end-before-start``
    a session's offline event read before its online event, or stamped earlier;
``overlap``
    two sessions of one device online at once for longer than ``lease`` seconds (a
    takeover across nodes, or a killed node's sessions until the lease lapses and a
    survivor sweeps them, overlap briefly by design).

Pure: events in, a :class:`HistoryReport` out. ``python -m loadtest history`` checks
presence logs (JSON lines) from the command line.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "HistoryReport", "Violation", "check_history", "merged_by_time"]

KINDS = ("no-start", "no-end", "duplicate-start", "duplicate-end", "end-before-start", "overlap")
"""Every kind of violation, in the order reports list them."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken promise: its kind, the device and session, and what was seen."""

    kind: str
    client_id: str | None
    epoch: str
    detail: str


@dataclass
class HistoryReport:
    """What :func:`check_history` found."""

    events: int = 0
    """Events read, those without a session (refusals, sockets that never sent CONNECT) included."""
    sessions: int = 0
    devices: int = 0
    violations: list[Violation] = field(default_factory=list)
    longest_overlap: float = 0.0
    """The longest time two sessions of one device were both online, lease or not (seconds)."""
    reannounced: int = 0
    """Sessions announced again, in a later run of the store or (``reannounced_copies``)
    by a word-for-word copy of their online event."""

    @property
    def ok(self) -> bool:
        """No violation."""
        return not self.violations

    def counts(self) -> dict[str, int]:
        """Violations by kind, every kind listed."""
        found = collections.Counter(v.kind for v in self.violations)
        return {kind: found[kind] for kind in KINDS}

    def summary(self, examples: int = 5) -> str:
        """One line, and a few examples of each kind found."""
        counts = self.counts()
        found = ", ".join(f"{kind} {n:,}" for kind, n in counts.items() if n) or "no violation"
        lines = [
            f"{self.events:,} events, {self.sessions:,} sessions of {self.devices:,} devices: {found}; "
            f"longest overlap of one device's sessions {self.longest_overlap * 1000:,.0f} ms; "
            f"{self.reannounced:,} announced again after their store was lost"
        ]
        for kind in KINDS:
            for v in [v for v in self.violations if v.kind == kind][:examples]:
                lines.append(f"  {kind}: {v.client_id} session {v.epoch}: {v.detail}")
        return "\n".join(lines)

    def as_dict(self, examples: int = 20) -> dict[str, Any]:
        """JSON-ready, with up to ``examples`` violations."""
        return {
            "ok": self.ok,
            "events": self.events,
            "sessions": self.sessions,
            "devices": self.devices,
            "violations": self.counts(),
            "longest_overlap_s": self.longest_overlap,
            "reannounced": self.reannounced,
            "examples": [
                {"kind": v.kind, "client_id": v.client_id, "epoch": v.epoch, "detail": v.detail}
                for v in self.violations[:examples]
            ],
        }


def merged_by_time(*logs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Several presence logs (of workers or gateways) as one history: by their events'
    time stamps, each log's own order kept among equal stamps (an event without one first)."""
    return sorted((e for log in logs for e in log), key=_time_or_first)


def _time_or_first(event: Mapping[str, Any]) -> float:
    when = _time(event)
    return -math.inf if math.isnan(when) else when


@dataclass
class _Session:
    epoch: str
    client_id: str | None = None
    starts: list[tuple[int, float, int]] = field(default_factory=list)
    """(position in the history, time, incarnation) of each online event."""
    first: dict[str, Any] | None = None
    """The first online event, to tell a word-for-word announcement again from another start."""
    ends: list[tuple[int, float]] = field(default_factory=list)
    """(position, time) of each offline event."""


def _time(event: Mapping[str, Any]) -> float:
    try:
        return float(event.get("time", math.nan))
    except (TypeError, ValueError):
        return math.nan


def check_history(
    events: Iterable[Mapping[str, Any]],
    *,
    lease: float = 0.0,
    complete: bool = True,
    reannounced_copies: bool = False,
) -> HistoryReport:
    """Check ``events`` (presence events as the log writes them, in the order read).

    ``lease``: how long two sessions of one device may both be online (seconds).
    ``complete``: the history holds everything up to the servers' stop, so a session
    without an end is a violation (False for a history cut short on purpose).
    ``reannounced_copies``: an online event repeated word for word is a session
    announced again after its store was lost (a gateway's log, which has no store
    runs), not a second start.
    """
    report = HistoryReport()
    sessions: dict[str, _Session] = {}
    last_time = -math.inf
    for position, event in enumerate(events):
        report.events += 1
        when = _time(event)
        if when > last_time:
            last_time = when
        epoch = event.get("epoch")
        status = event.get("status")
        if not epoch or status not in ("online", "offline"):
            continue  # not a session's: a refusal, a socket that never sent CONNECT
        s = sessions.get(str(epoch))
        if s is None:
            s = sessions[str(epoch)] = _Session(str(epoch))
        if event.get("client_id") is not None:
            s.client_id = str(event["client_id"])
        if status == "online":
            incarnation = int(event.get("incarnation", 0))
            if s.first is None:
                s.first = {k: v for k, v in event.items() if k != "incarnation"}
            elif reannounced_copies and {k: v for k, v in event.items() if k != "incarnation"} == s.first:
                incarnation = len(s.starts)  # an announcement again: a run of its own
            s.starts.append((position, when, incarnation))
        else:
            s.ends.append((position, when))
    report.sessions = len(sessions)
    flag = report.violations.append
    by_device: dict[str | None, list[_Session]] = collections.defaultdict(list)
    for s in sessions.values():
        by_device[s.client_id].append(s)
        if not s.starts:
            flag(Violation("no-start", s.client_id, s.epoch, f"{len(s.ends)} offline event(s), no online"))
            continue
        if not s.ends and complete:
            flag(Violation("no-end", s.client_id, s.epoch, "online, never ended"))
        per_run = collections.Counter(incarnation for _, _, incarnation in s.starts)
        if len(per_run) > 1:
            report.reannounced += 1
        twice = sorted(run for run, n in per_run.items() if n > 1)
        if twice:
            flag(Violation("duplicate-start", s.client_id, s.epoch, f"online twice in store run(s) {twice}"))
        if len(s.ends) > 1:
            flag(Violation("duplicate-end", s.client_id, s.epoch, f"{len(s.ends)} offline events"))
        if s.ends:
            first_start, first_end = min(s.starts), min(s.ends)
            if first_end[0] < first_start[0] or first_end[1] < first_start[1]:
                flag(
                    Violation(
                        "end-before-start",
                        s.client_id,
                        s.epoch,
                        f"offline read at {first_end[0]} (stamped {first_end[1]:.3f}), "
                        f"online at {first_start[0]} (stamped {first_start[1]:.3f})",
                    )
                )
    report.devices = len([device for device in by_device if device is not None])
    for device, held in by_device.items():
        _overlaps(report, device, held, lease, last_time)
    return report


def _overlaps(report: HistoryReport, device: str | None, held: list[_Session], lease: float, end: float) -> None:
    """Sweep one device's sessions by start: each against the latest-ending one before it."""
    spans = sorted(
        (min(t for _, t, _ in s.starts), min((t for _, t in s.ends), default=end), s.epoch) for s in held if s.starts
    )
    latest: tuple[float, str] | None = None
    for start, stop, epoch in spans:
        if latest is not None:
            overlap = min(latest[0], stop) - start
            if overlap > report.longest_overlap:
                report.longest_overlap = overlap
            if overlap > lease:
                report.violations.append(
                    Violation(
                        "overlap",
                        device,
                        epoch,
                        f"online {overlap:.3f} s while session {latest[1]} still was (lease {lease:g} s)",
                    )
                )
        if latest is None or stop > latest[0]:
            latest = (stop, epoch)
