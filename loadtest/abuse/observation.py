"""What an abuse run saw, as plain records: the healthy fleet's (:class:`FleetReport`),
the attacker's (:class:`AttackOutcome`), the server's presence log in brief
(:class:`LogSummary`) and the whole run of one attack on one server (:class:`Observation`).

The fleet (:mod:`.fleet`), the attacks and the runner (:mod:`.runner`) fill them in;
the judge (:mod:`.judge`) reads them. Data only: no I/O, no judgement.

Two clocks: the fleet's pings, probes and /healthz polls and the runner's phases are
stamped with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the
machine); presence events with ``time.time()``, as the server's presence log has them.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AttackOutcome", "Finding", "FleetReport", "LogSummary", "Observation", "PresenceSeen"]


@dataclass(frozen=True)
class PresenceSeen:
    """One message the healthy presence subscriber got on ``$SYS/presence/...``."""

    topic: str
    """The topic, cut to :data:`~.presence_audit.EXCERPT` characters (the hostile ones are 60 KB)."""
    digest: str
    """Of the whole topic and the payload read as JSON (:func:`~.presence_audit.digest`)."""
    client_id: str | None
    """The payload's ``client_id``, cut likewise; None if the payload is not a JSON object."""
    status: str | None
    """The payload's ``status``."""
    at: float
    """When it came (wall clock)."""
    wildcard: bool = False
    """The topic holds ``+`` or ``#``: no valid topic name (MQTT-4.7.1-1) may."""
    retained: bool = False
    """Sent as a retained message (on subscribing), not live."""


@dataclass
class FleetReport:
    """How the healthy fleet fared beside the attacker (the JSON the fleet process prints)."""

    devices: list[str] = field(default_factory=list)
    """The healthy devices' client ids."""
    pings: list[tuple[float, float]] = field(default_factory=list)
    """Every PINGREQ: (sent, round trip in s); the round trip is ``inf`` if no PINGRESP came."""
    probes: list[tuple[float, str, float]] = field(default_factory=list)
    """Every reconnect: (started, ``connack-<rc>`` or what else came, seconds it took)."""
    probe_ids: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Healthy connections the server closed, each with when."""
    presence: list[PresenceSeen] = field(default_factory=list)
    subscribed: tuple[float, float] = (0.0, 0.0)
    """The presence subscriber's window (wall clock): SUBACK in, DISCONNECT out; (0, 0) without one."""
    healthz: list[tuple[float, str]] = field(default_factory=list)
    """Every /healthz poll: (when, the status code, ``timeout`` or the error)."""
    lag: list[tuple[float, float]] = field(default_factory=list)
    """When the fleet's own loop was late by more than 20 ms, and by how much: a late
    PINGRESP then may be the fleet's fault, not the server's."""
    problems: list[str] = field(default_factory=list)
    """Anything else that went wrong with the fleet itself."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = dict(self.__dict__)
        out["presence"] = [p.__dict__ for p in self.presence]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetReport:
        """The inverse of :meth:`to_dict`."""
        fields = dict(data)
        fields["presence"] = [PresenceSeen(**p) for p in data.get("presence", [])]
        fields["pings"] = [tuple(p) for p in data.get("pings", [])]
        fields["probes"] = [tuple(p) for p in data.get("probes", [])]
        fields["healthz"] = [tuple(h) for h in data.get("healthz", [])]
        fields["lag"] = [tuple(x) for x in data.get("lag", [])]
        fields["subscribed"] = tuple(data.get("subscribed", (0.0, 0.0)))
        return cls(**fields)


@dataclass(frozen=True)
class Finding:
    """An attack's own check (a victim's retained value intact, say): passed or not, and why."""

    passed: bool
    detail: str


@dataclass
class AttackOutcome:
    """What the attacker did and what the server answered it."""

    units: int = 0
    """Hostile units sent: ids, filters, retained messages, held connections."""
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    """``connack-<rc>``, ``suback-<code>``, ``http-<status>``, ``closed``, ``timeout``, ... by count."""
    findings: dict[str, Finding] = field(default_factory=dict)
    """The attack's own checks, by name."""
    notes: list[str] = field(default_factory=list)


@dataclass
class LogSummary:
    """The server's presence log, in brief: what presence it really sent, by digest."""

    events: collections.Counter[str] = field(default_factory=collections.Counter)
    """Online and offline events, by :func:`~.presence_audit.digest` of their topic and payload."""
    sessions: set[str] = field(default_factory=set)
    """Client ids that had a session (an online event), cut to the excerpt length."""
    healthy: list[tuple[str, str, float, str]] = field(default_factory=list)
    """The healthy clients' events: (client id, status, time, digest)."""
    refused: int = 0
    """Refused CONNECTs logged."""


@dataclass
class Observation:
    """One attack on one server, as the runner saw it."""

    attack: str
    target: str
    baseline: tuple[float, float]
    """The no-attack phase (monotonic)."""
    window: tuple[float, float]
    """The attack phase (monotonic)."""
    fleet: FleetReport
    outcome: AttackOutcome
    rss_before: int
    """Server RSS at the end of the baseline (bytes)."""
    rss_peak: int
    """The most the server held during the attack and the checks after it."""
    rss_after: int
    unit: str
    per_unit: float
    """Bytes of RSS growth allowed per hostile unit (beyond the slack)."""
    log: LogSummary | None = None
    """None: the server has no presence (Mosquitto)."""
    status_port: bool = False
    """The server has a status port (/healthz)."""
    died: str = ""
    """Why the server is not alive at the end (empty if it is)."""
