"""The presence-history checker (loadtest/history.py) against histories built to keep,
or to break, exactly one promise; and ``python -m loadtest history`` on real logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.history import KINDS, check_history
from loadtest.history_cli import main

Event = dict[str, Any]


def online(epoch: str, device: str, at: float, incarnation: int = 0) -> Event:
    return {"status": "online", "client_id": device, "epoch": epoch, "time": at, "incarnation": incarnation}


def offline(epoch: str, device: str, at: float, reason: str = "disconnect") -> Event:
    return {"status": "offline", "client_id": device, "epoch": epoch, "time": at, "reason": reason}


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """A history that keeps every promise: each device's sessions one after another
    (a takeover's end and the next start may share a stamp), devices interleaved by time."""
    events: list[Event] = []
    for d in range(draw(st.integers(1, 6))):
        t = draw(st.floats(0, 10))
        for n in range(draw(st.integers(1, 5))):
            start = round(t + draw(st.floats(0, 5)), 3)
            stop = round(start + draw(st.floats(0.001, 30)), 3)
            if stop <= start:
                # Rounded to the stamp's millisecond, a session can lose its length: its
                # end would then sort before its own start, a history no server writes.
                stop = round(start + 0.001, 3)
            epoch = f"w{d}.{n}"
            events += [online(epoch, f"dev-{d}", start), offline(epoch, f"dev-{d}", stop)]
            t = stop
    events.sort(key=lambda e: (e["time"], e["status"] == "online"))  # an end before a start at one stamp
    return events


def kinds(events: list[Event], **kw: Any) -> set[str]:
    return {v.kind for v in check_history(events, **kw).violations}


@given(histories())
def test_a_history_that_keeps_its_promises_passes(events: list[Event]) -> None:
    report = check_history(events)
    assert report.ok, report.summary()
    assert report.sessions == len(events) // 2
    # Refusals and sockets that never said CONNECT are no session's: they change nothing.
    noise: list[Event] = [
        {"status": "refused", "client_id": None, "claimed_client_id": "dev-0", "time": 1.0},
        {"status": "offline"},
    ]
    assert check_history(noise + events).ok


@settings(max_examples=200)
@given(histories(), st.data())
def test_each_broken_promise_is_named_and_nothing_else(events: list[Event], data: st.DataObject) -> None:
    fault = data.draw(st.sampled_from(KINDS))
    starts = [i for i, e in enumerate(events) if e["status"] == "online"]
    if fault == "no-end":
        # A device's last session: an earlier one left open would also overlap the later ones.
        last = {events[i]["client_id"]: i for i in starts}
        starts = sorted(last.values())
    if fault == "overlap":
        # A session with one of the device's before it, to start inside that one.
        seen: set[str] = set()
        later = []
        for i in starts:
            if events[i]["client_id"] in seen:
                later.append(i)
            seen.add(events[i]["client_id"])
        if not later:
            return
        starts = later
    i = data.draw(st.sampled_from(starts))
    epoch, device = events[i]["epoch"], events[i]["client_id"]
    j = next(k for k, e in enumerate(events) if e["epoch"] == epoch and e["status"] == "offline")
    broken = [dict(e) for e in events]
    if fault == "no-start":
        del broken[i]
    elif fault == "no-end":
        del broken[j]
        assert kinds(broken, complete=False) == set()  # a history cut short on purpose
    elif fault == "duplicate-start":
        broken.insert(j, dict(broken[i]))
        again = [dict(e) for e in broken]
        again[j]["incarnation"] = 1  # announced again after an empty store's restart: fine
        assert kinds(again) == set()
    elif fault == "duplicate-end":
        broken.append(dict(broken[j]))
    elif fault == "end-before-start":
        broken.insert(i, broken.pop(j))  # read first; stamped as before
    else:
        mine = [e for e in events[:i] if e["client_id"] == device]
        previous_start, previous_end = mine[-2]["time"], mine[-1]["time"]
        both = min(2.0, previous_end - previous_start)  # online this long while the previous session was
        broken[i]["time"] = previous_end - both
        assert "overlap" in kinds(broken, lease=both / 2)
        # Within a longer lease, no overlap; stamped early, it may be stamped before an
        # end read ahead of it.
        assert kinds(broken, lease=both + 0.01) <= {"end-before-start"}
        assert kinds(broken) <= {"overlap", "end-before-start"}
        return
    assert kinds(broken) == {fault}


def test_a_log_s_word_for_word_announcement_again_is_no_second_start() -> None:
    # A gateway's log after an empty Redis restart: its sessions announced again.
    first = online("a", "lamp", 1.0)
    events = [first, dict(first), offline("a", "lamp", 5.0)]
    assert {v.kind for v in check_history(events).violations} == {"duplicate-start"}
    report = check_history(events, reannounced_copies=True)
    assert report.ok and report.reannounced == 1
    moved = dict(first, time=2.0)  # not a copy: a second start
    assert {v.kind for v in check_history([first, moved, events[2]], reannounced_copies=True).violations} == {
        "duplicate-start"
    }


def test_an_overlap_within_the_lease_passes_and_is_measured() -> None:
    events = [
        online("a", "lamp", 0.0),
        online("b", "lamp", 5.0),  # the device came back through another gateway
        offline("a", "lamp", 8.0, "node-lost"),  # the dead gateway's session, swept at its lease
        offline("b", "lamp", 20.0),
    ]
    assert check_history(events, lease=10.0).ok
    report = check_history(events, lease=2.0)
    assert [(v.kind, v.epoch) for v in report.violations] == [("overlap", "b")]
    assert report.longest_overlap == 3.0
    assert "overlap 1" in report.summary()


def test_an_unended_session_overlaps_until_the_history_ends() -> None:
    events = [online("a", "lamp", 0.0), online("b", "lamp", 1.0), offline("b", "lamp", 2.0)]
    found = {v.kind for v in check_history(events, complete=False).violations}
    assert found == {"overlap"}


def test_the_command_merges_logs_by_time_and_fails_on_a_violation(tmp_path: Path) -> None:
    first, second = tmp_path / "gw0.jsonl", tmp_path / "gw1.jsonl"
    first.write_text("\n".join(json.dumps(e) for e in [online("a", "lamp", 1.0), offline("a", "lamp", 3.0)]) + "\n")
    second.write_text(
        "not json\n" + json.dumps(online("b", "lamp", 3.0)) + "\n" + json.dumps(offline("b", "lamp", 4.0))
    )
    out = tmp_path / "report.json"
    assert main([str(first), str(second), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["sessions"] == 2
    second.write_text(json.dumps(online("b", "lamp", 2.0)) + "\n" + json.dumps(offline("b", "lamp", 4.0)))
    assert main([str(first), str(second)]) == 1  # lamp online twice for a second
    assert main([str(first), str(second), "--lease", "1.5"]) == 0
    assert main([str(tmp_path / "missing.jsonl")]) == 2
