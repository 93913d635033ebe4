"""The abuse run's judge: did the attack hurt a healthy client, or cost memory past its
bound? Pure: an :class:`~.observation.Observation` in, a :class:`Verdict` out.

Each check is PASS, FAIL, or ``n/a`` where the server has nothing to check (Mosquitto
has no presence topics and no status port); the verdict passes when no check fails.

- ``round-trip``: the healthy fleet's p99 PINGREQ round trip under attack within the
  larger of :attr:`Limits.p99_floor` and :attr:`Limits.p99_factor` times the baseline's
  p99 (measured on the same server just before), and every PINGREQ answered;
- ``connects``: every healthy reconnect accepted (CONNACK 0), some of them during the attack;
- ``online``: no healthy connection closed by the server;
- ``presence-forged``: every presence message the healthy subscriber got is an event of
  the server's own log (same topic, same content, no more often live; its retained copy
  aside), on a topic without wildcards;
- ``presence-lost``: every event of a healthy client the log holds for the
  subscriber's window reached it;
- ``healthz``: every /healthz poll answered 200;
- ``memory``: the server's RSS grew by at most :attr:`Limits.rss_slack` plus the
  attack's bytes per hostile unit times the units sent;
- ``server``: it is still running;
- and each of the attack's own findings (a victim's retained value, say).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from ..report import plural
from ..stats import percentile
from .observation import FleetReport, LogSummary, Observation

__all__ = ["Check", "Limits", "Verdict", "figures", "judge", "round_trips"]

NA = "n/a"


@dataclass(frozen=True)
class Limits:
    """What counts as hurt."""

    p99_floor: float = 0.050
    """Seconds: a p99 round trip under attack within this always passes (a loaded 2-core machine's noise)."""
    p99_factor: float = 10.0
    """Times the baseline p99 a p99 under attack may reach, when that is more than the floor."""
    rss_slack: int = 16 * 2**20
    """Bytes of RSS growth allowed whatever the attack (the allocator's noise, the fleet's own state)."""


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``PASS``, ``FAIL`` or ``n/a``, and why."""

    name: str
    status: str
    detail: str


@dataclass
class Verdict:
    """Every check of one attack on one server."""

    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No check failed."""
        return all(c.status != "FAIL" for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        """The failed checks, each as ``name: why``."""
        return [f"{c.name}: {c.detail}" for c in self.checks if c.status == "FAIL"]


def _check(name: str, ok: bool, detail: str) -> Check:
    return Check(name, "PASS" if ok else "FAIL", detail)


def round_trips(fleet: FleetReport, window: tuple[float, float]) -> list[float]:
    """Round trips (s) of the PINGREQs sent within ``window``; ``inf`` for those unanswered."""
    start, end = window
    return [rtt for sent, rtt in fleet.pings if start <= sent < end]


def _ms(seconds: float) -> str:
    return "never" if seconds == math.inf else f"{seconds * 1000:,.1f} ms"


def figures(obs: Observation) -> dict[str, float]:
    """The run's figures: round trips (ms) before and under attack, RSS growth, per unit."""
    base = round_trips(obs.fleet, obs.baseline)
    under = round_trips(obs.fleet, obs.window)
    growth = obs.rss_peak - obs.rss_before
    units = obs.outcome.units
    return {
        "baseline_p50_ms": percentile(base, 50) * 1000,
        "baseline_p99_ms": percentile(base, 99) * 1000,
        "p50_ms": percentile(under, 50) * 1000,
        "p99_ms": percentile(under, 99) * 1000,
        "max_ms": max(under, default=math.nan) * 1000,
        "pings": len(under),
        "unanswered": sum(1 for r in under if r == math.inf),
        "rss_before_mib": obs.rss_before / 2**20,
        "rss_growth_mib": growth / 2**20,
        "units": units,
        "bytes_per_unit": growth / units if units else math.nan,
        "fleet_lag_ms": max((late for at, late in obs.fleet.lag if obs.window[0] <= at < obs.window[1]), default=0.0)
        * 1000,
    }


def _round_trip(obs: Observation, limits: Limits) -> Check:
    base = round_trips(obs.fleet, obs.baseline)
    under = round_trips(obs.fleet, obs.window)
    if not base or not under:
        return _check("round-trip", False, f"no round trips measured ({len(base)} before, {len(under)} under attack)")
    base_p99 = percentile(base, 99)
    p99 = percentile(under, 99)
    bound = max(limits.p99_floor, limits.p99_factor * base_p99)
    missing = sum(1 for r in under if r == math.inf)
    detail = f"p99 {_ms(p99)} under attack, bound {_ms(bound)} (baseline p99 {_ms(base_p99)}), {len(under):,} pings"
    if missing:
        detail += f", {missing:,} never answered"
    lag = figures(obs)["fleet_lag_ms"]
    if lag > limits.p99_floor * 1000:
        detail += f" (the fleet's own loop was up to {lag:,.0f} ms late)"
    return _check("round-trip", p99 <= bound and not missing, detail)


def _connects(obs: Observation) -> Check:
    probes = obs.fleet.probes
    during = [p for p in probes if obs.window[0] <= p[0] < obs.window[1]]
    refused = [p for p in probes if p[1] != "connack-0"]
    if refused:
        shown = "; ".join(f"{outcome} after {took:.2f} s" for _, outcome, took in refused[:3])
        return _check("connects", False, f"{len(refused)} of {len(probes)} healthy reconnects refused: {shown}")
    if not during:
        return _check("connects", False, "no healthy reconnect ran during the attack")
    slowest = max(took for _, _, took in during)
    return _check("connects", True, f"{len(during)} healthy reconnects during the attack, slowest {_ms(slowest)}")


def _online(obs: Observation) -> Check:
    trouble = obs.fleet.dropped + obs.fleet.problems
    if trouble:
        return _check("online", False, f"{plural(len(trouble), 'healthy client')} hurt: {'; '.join(trouble[:3])}")
    return _check("online", True, f"all {len(obs.fleet.devices)} healthy devices stayed connected")


def _forged(fleet: FleetReport, log: LogSummary) -> Check:
    left = collections.Counter(log.events)
    bad: list[str] = []
    for msg in fleet.presence:
        if msg.wildcard:
            bad.append(f"{msg.topic} (a topic with a wildcard)")
        elif msg.retained and log.events[msg.digest] > 0:
            # The stored copy of an event, sent on subscribing; its live copy may come
            # too (MQTT 3.3.1.3), as in a fleet, where the live one comes through Redis.
            continue
        elif left[msg.digest] > 0:
            left[msg.digest] -= 1
        elif msg.client_id is not None and msg.client_id not in log.sessions:
            bad.append(f"{msg.topic} ({msg.status}: {msg.client_id} never had a session)")
        else:
            bad.append(f"{msg.topic} ({msg.status}: not an event of the server's log)")
    n = len(fleet.presence)
    if bad:
        return _check("presence-forged", False, f"{len(bad)} of {n} presence messages forged: {'; '.join(bad[:3])}")
    return _check("presence-forged", True, f"all {n} presence messages are the server's own")


def _lost(fleet: FleetReport, log: LogSummary) -> Check:
    start, end = fleet.subscribed
    got = {msg.digest for msg in fleet.presence}
    due = [e for e in log.healthy if start <= e[2] <= end]
    lost = [e for e in due if e[3] not in got]
    if not due:
        return _check("presence-lost", False, "no healthy presence event logged while the subscriber listened")
    if lost:
        shown = "; ".join(f"{status} of {client_id}" for client_id, status, _, _ in lost[:3])
        return _check("presence-lost", False, f"{len(lost)} of {len(due)} healthy presence events lost: {shown}")
    return _check("presence-lost", True, f"all {len(due)} healthy presence events delivered")


def _presence(obs: Observation) -> list[Check]:
    if obs.log is None:
        return [Check("presence-forged", NA, "no presence topics"), Check("presence-lost", NA, "no presence topics")]
    return [_forged(obs.fleet, obs.log), _lost(obs.fleet, obs.log)]


def _healthz(obs: Observation) -> Check:
    if not obs.status_port:
        return Check("healthz", NA, "no status port")
    polls = obs.fleet.healthz
    bad = [(at, status) for at, status in polls if status != "200"]
    if not polls:
        return _check("healthz", False, "/healthz never polled")
    if bad:
        kinds = collections.Counter(status for _, status in bad)
        shown = ", ".join(f"{status} x{n}" for status, n in kinds.most_common())
        return _check("healthz", False, f"{len(bad)} of {len(polls)} /healthz polls not 200: {shown}")
    return _check("healthz", True, f"all {len(polls)} /healthz polls 200")


def _memory(obs: Observation, limits: Limits) -> Check:
    growth = obs.rss_peak - obs.rss_before
    units = obs.outcome.units
    bound = limits.rss_slack + obs.per_unit * units
    per = f", {growth / units:+,.0f} B per {obs.unit}" if units else ""
    detail = (
        f"RSS {growth / 2**20:+,.1f} MiB{per} for {units:,} {obs.unit}s "
        f"(bound {bound / 2**20:,.1f} MiB: {limits.rss_slack / 2**20:.0f} MiB + {obs.per_unit:,.0f} B per {obs.unit})"
    )
    return _check("memory", growth <= bound, detail)


def judge(obs: Observation, limits: Limits | None = None) -> Verdict:
    """Every check of one run."""
    limits = limits or Limits()
    verdict = Verdict(
        [
            _round_trip(obs, limits),
            _connects(obs),
            _online(obs),
            *_presence(obs),
            _healthz(obs),
            _memory(obs, limits),
            _check("server", not obs.died, obs.died or "running at the end"),
        ]
    )
    for name, finding in obs.outcome.findings.items():
        verdict.checks.append(_check(name, finding.passed, finding.detail))
    return verdict
