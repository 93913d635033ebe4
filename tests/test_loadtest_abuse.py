"""``python -m loadtest abuse``: the judge judges (hand-made observations, each hurt in
one way, must fail on that check alone), presence messages are matched against the
log however the JSON is spaced, and a short real run against ours and Mosquitto
gives a report of the right shape whose verdicts follow from what the server did."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.abuse import cli
from loadtest.abuse.catalog import ATTACKS, pick
from loadtest.abuse.judge import Limits, judge
from loadtest.abuse.observation import AttackOutcome, Finding, FleetReport, LogSummary, Observation, PresenceSeen
from loadtest.abuse.presence_audit import PRESENCE_PREFIX as PRESENCE
from loadtest.abuse.presence_audit import digest, read_log, seen
from loadtest.abuse.report import not_applicable, record, render, table
from loadtest.mqtt_targets import mosquitto_binary

DEVICE = "healthy-device-0"
ONLINE = {"status": "online", "client_id": DEVICE, "peer": "127.0.0.1:5000", "reason": None, "epoch": "0.1.1"}
BASELINE = (100.0, 103.0)
WINDOW = (103.0, 111.0)
MIB = 2**20


def _pings(window: tuple[float, float], rtt: float, n: int = 200) -> list[tuple[float, float]]:
    start, end = window
    return [(start + (end - start) * i / n, rtt) for i in range(n)]


def _message(topic: str, event: dict[str, Any]) -> PresenceSeen:
    # As the server sends it: compact JSON, where its log spaces it.
    return seen(topic, json.dumps(event, separators=(",", ":")).encode())


def clean(**changes: Any) -> Observation:
    """An observation of an attack that hurt nobody; ``changes`` hurt it in one way."""
    logged = digest(f"{PRESENCE}{DEVICE}", json.dumps(ONLINE).encode())
    fleet = FleetReport(
        devices=[DEVICE],
        pings=_pings(BASELINE, 0.0005) + _pings(WINDOW, 0.001),
        probes=[(104.0 + i, "connack-0", 0.002) for i in range(5)],
        presence=[_message(f"{PRESENCE}{DEVICE}", ONLINE)],
        subscribed=(1000.0, 2000.0),
        healthz=[(100.0 + i, "200") for i in range(20)],
    )
    log = LogSummary(
        events=collections.Counter({logged: 1}),
        sessions={DEVICE},
        healthy=[(DEVICE, "online", 1500.0, logged)],
    )
    obs = Observation(
        attack="made-up",
        target="idlekeeper",
        baseline=BASELINE,
        window=WINDOW,
        fleet=fleet,
        outcome=AttackOutcome(units=100),
        rss_before=40 * MIB,
        rss_peak=41 * MIB,
        rss_after=41 * MIB,
        unit="id",
        per_unit=4096.0,
        log=log,
        status_port=True,
    )
    for name, value in changes.items():
        setattr(obs, name, value)
    return obs


def failed(obs: Observation, limits: Limits | None = None) -> list[str]:
    return [c.name for c in judge(obs, limits).checks if c.status == "FAIL"]


def test_a_run_that_hurt_nobody_passes_every_check() -> None:
    verdict = judge(clean())
    assert verdict.passed, verdict.reasons
    assert [c.status for c in verdict.checks] == ["PASS"] * 8
    names = "round-trip connects online presence-forged presence-lost healthz memory server"
    assert [c.name for c in verdict.checks] == names.split()


def test_a_late_round_trip_under_attack_fails() -> None:
    obs = clean()
    obs.fleet.pings = _pings(BASELINE, 0.0005) + _pings(WINDOW, 0.001, 190) + _pings(WINDOW, 0.168, 10)
    assert failed(obs) == ["round-trip"]
    assert "168.0 ms" in judge(obs).reasons[0]


def test_the_round_trip_bound_follows_the_baseline_above_the_floor() -> None:
    obs = clean()
    obs.fleet.pings = _pings(BASELINE, 0.020) + _pings(WINDOW, 0.150)
    assert failed(obs) == []  # 10 x the 20 ms baseline
    obs.fleet.pings = _pings(BASELINE, 0.020) + _pings(WINDOW, 0.250)
    assert failed(obs) == ["round-trip"]
    assert failed(obs, Limits(p99_floor=0.3)) == []


def test_a_ping_never_answered_fails() -> None:
    obs = clean()
    obs.fleet.pings.append((WINDOW[0] + 1, math.inf))
    assert failed(obs) == ["round-trip"]
    assert "1 never answered" in judge(obs).reasons[0]


def test_a_refused_healthy_reconnect_fails_and_so_does_none_at_all() -> None:
    obs = clean()
    obs.fleet.probes[2] = (106.0, "connack-3", 0.001)
    assert failed(obs) == ["connects"]
    obs.fleet.probes = [(99.0, "connack-0", 0.001)]  # only before the attack
    assert failed(obs) == ["connects"]


def test_a_healthy_device_dropped_fails() -> None:
    obs = clean()
    obs.fleet.dropped.append(f"{DEVICE} closed by the server at 105.000")
    assert failed(obs) == ["online"]


def test_forged_presence_fails_for_a_ghost_an_impostor_a_replay_and_a_wildcard() -> None:
    ghost = {"status": "online", "client_id": "ghost-0"}
    impostor = {**ONLINE, "status": "offline", "reason": "keepalive-timeout"}
    wild = {**ONLINE, "client_id": "wild+1"}
    for message in (
        _message(f"{PRESENCE}ghost-0", ghost),  # never had a session
        _message(f"{PRESENCE}{DEVICE}", impostor),  # had one, but the server never said this
        _message(f"{PRESENCE}{DEVICE}", ONLINE),  # the server's own event, a second time
        _message(f"{PRESENCE}wild+1", wild),  # a topic name with a wildcard
        seen(f"{PRESENCE}{DEVICE}", b"not json"),
    ):
        obs = clean()
        obs.fleet.presence.append(message)
        assert failed(obs) == ["presence-forged"], message
    obs = clean()
    obs.fleet.presence.append(_message(f"{PRESENCE}ghost-0", ghost))
    assert "ghost-0 never had a session" in judge(obs).reasons[0]


def test_a_retained_copy_of_an_event_beside_its_live_copy_is_not_a_replay() -> None:
    # A fleet sends a subscriber the event stored in Redis and, through the stream, the live one.
    obs = clean()  # its subscriber got the device's online event live, once, as logged
    obs.fleet.presence.insert(0, seen(f"{PRESENCE}{DEVICE}", json.dumps(ONLINE).encode(), retained=True))
    assert failed(obs) == []
    obs.fleet.presence.append(_message(f"{PRESENCE}{DEVICE}", ONLINE))  # live a second time: a replay
    assert failed(obs) == ["presence-forged"]
    # A retained message is no licence to forge: it must be an event of the log.
    obs = clean()
    ghost = {"status": "online", "client_id": "ghost-0"}
    obs.fleet.presence.append(seen(f"{PRESENCE}ghost-0", json.dumps(ghost).encode(), retained=True))
    assert failed(obs) == ["presence-forged"]


def test_a_lost_presence_event_fails_inside_the_subscribers_window_only() -> None:
    obs = clean()
    obs.fleet.presence = []
    assert failed(obs) == ["presence-lost"]
    obs.fleet.subscribed = (1600.0, 2000.0)  # the event came before the subscriber listened
    assert failed(obs) == ["presence-lost"]  # nothing was due: the check is void, not passed
    assert "no healthy presence event" in judge(obs).reasons[0]


def test_healthz_not_200_fails() -> None:
    obs = clean()
    obs.fleet.healthz[5] = (105.0, "503")
    obs.fleet.healthz[6] = (105.5, "timeout")
    assert failed(obs) == ["healthz"]
    assert "503 x1" in judge(obs).reasons[0]


def test_memory_past_the_attacks_bound_fails() -> None:
    obs = clean()
    bound = Limits().rss_slack + int(obs.per_unit) * obs.outcome.units
    obs.rss_peak = obs.rss_before + bound
    assert failed(obs) == []
    obs.rss_peak += 1
    assert failed(obs) == ["memory"]


def test_a_dead_server_and_an_attacks_own_finding_fail() -> None:
    assert failed(clean(died="exited with -9 during the run")) == ["server"]
    obs = clean()
    obs.outcome.findings["victim-retained"] = Finding(False, "holds nothing")
    assert failed(obs) == ["victim-retained"]


def test_checks_a_server_has_nothing_for_are_not_applicable_never_passed_or_failed() -> None:
    obs = clean(log=None, status_port=False)
    obs.fleet.presence = []
    obs.fleet.healthz = []
    verdict = judge(obs)
    assert verdict.passed
    assert {c.name for c in verdict.checks if c.status == "n/a"} == {"presence-forged", "presence-lost", "healthz"}


def test_presence_matches_the_log_however_its_json_is_spaced(tmp_path: Path) -> None:
    log = tmp_path / "presence.jsonl"
    refused = {"status": "refused", "client_id": None, "claimed_client_id": DEVICE}
    offline = {**ONLINE, "status": "offline", "reason": "disconnect"}
    log.write_text("".join(json.dumps(e) + "\n" for e in (ONLINE, refused, offline, {**ONLINE, "client_id": "other"})))
    summary = read_log(log, {DEVICE})
    assert summary.refused == 1
    assert summary.sessions == {DEVICE, "other"}
    assert [(c, s) for c, s, _, _ in summary.healthy] == [(DEVICE, "online"), (DEVICE, "offline")]
    wire = _message(f"{PRESENCE}{DEVICE}", offline)
    assert summary.events[wire.digest] == 1
    assert summary.events[_message(f"{PRESENCE}other", offline).digest] == 0  # same content, another topic
    assert wire.status == "offline" and wire.client_id == DEVICE and not wire.wildcard
    assert seen(f"{PRESENCE}a#", b"{}").wildcard


def test_the_catalog_and_the_report() -> None:
    assert [cls.name for cls in pick("all")] == list(ATTACKS)
    assert [cls.name for cls in pick("connect-flood,will-forgery")] == ["will-forgery", "connect-flood"]
    with pytest.raises(ValueError, match="unknown attack nope"):
        pick("will-forgery,nope")
    obs = clean()
    obs.outcome.answers["connack-0"] = 100
    rec = record(obs, judge(obs), "a made-up attack")
    text = render(rec)
    assert text.splitlines()[0].split() == ["made-up", "idlekeeper", "PASS"]
    assert "connack-0 x100" in text and "PASS round-trip" in text
    starve = ATTACKS["status-starve"]
    rows = table([rec, not_applicable(starve, "mosquitto")]).splitlines()
    assert len(rows) == 4  # the head, its rule, a row per attack and server run
    assert rows[2].startswith("| made-up | idlekeeper | PASS | 1.00 ms (0.50) | — | +10,486 B/id | connack-0 x100 |")
    assert rows[3].startswith("| status-starve | mosquitto | n/a: no status port |")


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto is not installed")
def test_a_short_real_run_is_judged_by_what_the_server_did(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    argv = ["--targets", "idlekeeper,fleet,mosquitto", "--attacks", "will-forgery,wildcard-ids"]
    argv += ["--healthy", "3", "--seconds", "2", "--baseline", "1", "--json", str(out), "--quiet"]
    code = cli.main(argv)
    data = json.loads(out.read_text())
    runs = {(r["attack"], r["target"]): r for r in data["runs"]}
    targets = ("idlekeeper", "fleet", "mosquitto")
    assert set(runs) == {(a, t) for a in ("will-forgery", "wildcard-ids") for t in targets}
    ours_failed = [r["attack"] for r in data["runs"] if r["target"] != "mosquitto" and r["result"] == "FAIL"]
    assert code == (1 if ours_failed else 0)
    assert data["result"] == ("FAIL" if ours_failed else "PASS")
    assert out.with_suffix(".md").read_text().startswith("| attack | server | result |")
    # Mosquitto has no presence: the attack on it is not applicable, neither passed nor failed.
    assert runs["wildcard-ids", "mosquitto"]["result"] == "n/a"

    ran = [("will-forgery", t) for t in targets] + [("wildcard-ids", "idlekeeper"), ("wildcard-ids", "fleet")]
    for key in ran:
        run = runs[key]
        assert "figures" in run, run["reasons"]
        f = run["figures"]
        assert f["pings"] > 0 and f["baseline_p99_ms"] > 0 and f["units"] > 0
        assert sum(run["answers"].values()) >= f["units"]  # every attacker was answered, or counted unanswered
        checks = {c["name"]: c["status"] for c in run["checks"]}
        assert checks["connects"] == "PASS", run["checks"]  # a reconnect ran, accepted
        if key[1] == "mosquitto":
            assert checks["presence-forged"] == checks["healthz"] == "n/a"

    # Ours: a Will accepted on a ghost's presence topic is published when its forger
    # resets (retained), so the judge must find it; refused (CONNACK 5), nothing is forged.
    for ours in targets[:2]:
        forged = runs["will-forgery", ours]
        checks = {c["name"]: c["status"] for c in forged["checks"]}
        ghosts_in = forged["answers"].get("ghost-connack-0", 0)
        assert checks["presence-forged"] == checks["retained-ghosts"] == ("FAIL" if ghosts_in else "PASS")
        assert checks["presence-lost"] == "PASS" and checks["healthz"] == "PASS"
        # An id with a wildcard accepted becomes a presence topic with one; refused, none does.
        wild = runs["wildcard-ids", ours]
        checks = {c["name"]: c["status"] for c in wild["checks"]}
        assert checks["presence-forged"] == ("FAIL" if wild["answers"].get("connack-0", 0) else "PASS")
