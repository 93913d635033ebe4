"""The verdict on a fuzz run, from what the runner observed. Pure.

The runner (:mod:`.runner`) collects an :class:`~.observation.Observation`;
:func:`judge` turns it into a :class:`Verdict`. A run passes only if every one of these holds:

- the server process was alive throughout and exited 0 when stopped by SIGTERM;
- its stderr holds no traceback and no ERROR or CRITICAL record;
- every connection had a clear outcome: the server answered (a CONNACK refusal
  code, 3.x or 5.0, a 5.0 DISCONNECT's reason code, an HTTP status) and/or closed
  it, or we reset it ourselves. A connection we half-closed, or left to the
  server's own timeouts, must have been closed by the server within its longest
  timeout plus a margin (a peer that keeps some open by design, as Mosquitto does a
  connection that never sends its CONNECT, has them counted instead). A 5.0 packet
  from the server that does not parse is a fault, as is HTTP 500;
- MQTT: every connection's end is in the presence log, with its reason (a protocol
  error names which one);
- WebSocket: every input got an answer its fault warrants (:attr:`~.corpus.Case.expect`:
  the RFC 6455 close code for the fault, an HTTP status for a bad handshake, or what a
  valid input gets), every frame the server sent is one a client may take, and the echo
  app's messages came back as they were sent;
- the canary stayed healthy: no false offline, every ping answered, every HTTP
  request 200, and the server kept accepting new connections;
- the server's open files came back to what they were before the run (no leaked
  sockets), and its RSS did not keep growing with the inputs through the second half
  of the run (taken each time with the server idle);
- the run did every input it was asked for, within its time limit.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .faults import fault_summary, log_faults
from .mutators_ws import ANY
from .observation import ConnRecord, Observation
from .replies import ACCEPTED

__all__ = ["Limits", "Verdict", "judge", "suspects_at", "unclear", "ws_fits"]

UNJUDGED = ("aborted", "connect-failed", "stuck", "open", "cut")
"""Endings whose answer is not there to judge: we reset it, it never opened, it is held
(judged as such), or we stopped reading."""


@dataclass
class Limits:
    """What the judge tolerates."""

    wait: float
    """Seconds a connection we half-closed or left to the server may stay open."""
    rss_growth: float = 256.0
    """Bytes of server RSS per input in the run's second half beyond which memory is said
    to grow without bound (a server whose caches fill up early levels off before then)..."""
    rss_slack: float = 16 * 2**20
    """...if it also grew more than this many bytes then: a short run's RSS is noise."""
    connect_failures: float = 0.01
    """Share of connects that may fail (the listen queue overflowing under load)."""
    holds: str = ""
    """Why the server may keep a connection open past ``wait`` by design (a peer's documented
    behaviour: such connections are counted, not failed); empty for ours."""
    handshake: float = 1.0
    """Seconds our servers give a connection to send its opening handshake (``--header-timeout``,
    ``--connect-timeout`` in a fuzz run): a WebSocket input the fuzzer took longer to send may be
    cut before its answer, which is counted, not failed."""


@dataclass
class Verdict:
    """PASS or FAIL, why, and the counts."""

    passed: bool
    reasons: list[str]
    counts: dict[str, Any]


def _top(counter: collections.Counter[str], n: int = 12) -> dict[str, int]:
    return dict(counter.most_common(n))


def _presence_check(obs: Observation, records: Sequence[ConnRecord]) -> tuple[list[str], dict[str, Any]]:
    """Every fuzz connection's end must be in the presence log, protocol errors with their reason."""
    events = obs.presence or []
    ends = [e for e in events if e.get("status") in ("offline", "refused")]
    by_peer: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    unexplained = 0
    for e in ends:
        peer = str(e.get("peer", "?"))
        if peer in obs.canary_peers:
            continue
        by_peer[peer] += 1
        reason = str(e.get("reason"))
        detail = str(e.get("detail", ""))
        if reason == "protocol-error":
            if not detail:
                unexplained += 1
            reasons[f"protocol-error: {detail or '?'}"] += 1
        elif reason == "refused":
            reasons[f"refused: {detail.split(':')[0]}"] += 1
        else:
            reasons[reason] += 1
    ours: collections.Counter[str] = collections.Counter(r.peer for r in records if r.peer)
    missing = sum(max(0, n - by_peer.get(peer, 0)) for peer, n in ours.items())
    # An end logged with no peer ("?": the socket was reset before the server asked) or
    # a peer we never had can only belong to a connection whose own peer is missing.
    spare = sum(n for peer, n in by_peer.items() if peer not in ours)
    # Where a peer carried one connection, its reply and the server's reason must agree.
    single = {peer for peer, n in ours.items() if n == 1 and by_peer.get(peer) == 1}
    reason_of = {str(e.get("peer")): str(e.get("reason")) for e in ends if str(e.get("peer")) in single}
    disagree = sum(
        1
        for r in records
        if r.peer in single
        and r.reply.startswith("connack-")
        and r.reply not in ACCEPTED
        and reason_of.get(r.peer) not in ("refused", "protocol-error")
    )
    # Of the peers short of ends, how many connections had been accepted (CONNACK 0 read).
    short = {peer for peer, n in ours.items() if by_peer.get(peer, 0) < n}
    accepted = sum(1 for r in records if r.peer in short and r.reply in ACCEPTED)
    problems = []
    if missing > spare:
        problems.append(
            f"{missing - spare} connections have no end in the presence log "
            f"({missing} without one by peer, {spare} ends logged without a known peer; "
            f"{accepted} of those without had read CONNACK 0)"
        )
    if unexplained:
        problems.append(f"{unexplained} protocol-error closes were logged without their reason")
    if disagree:
        problems.append(f"{disagree} CONNACK refusals were not logged as refused or protocol-error")
    counts = {
        "server_reasons": _top(reasons, 40),
        "unattributed_ends": spare,
        "missing_ends": missing,
        "missing_accepted": accepted,
    }
    return problems, counts


def ws_fits(r: ConnRecord) -> bool:
    """Whether a WebSocket connection's answer is one its fault warrants."""
    if ANY in r.expect:
        # Blind damage: any clear answer will do, none the server may not give.
        return not r.ws.startswith(("bad-", "http-garbage", "http-5"))
    return r.ws in r.expect


def _samples(records: Sequence[ConnRecord], n: int = 8) -> str:
    return ", ".join(str(r.index) for r in records[:n])


def _ws_check(records: Sequence[ConnRecord], handshake: float) -> tuple[list[str], dict[str, Any]]:
    """Every WebSocket input's answer against its fault; the server's frames; the echoes."""
    by_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    wrong: dict[str, list[ConnRecord]] = collections.defaultdict(list)
    bad: list[ConnRecord] = []
    echoes: list[ConnRecord] = []
    lost = checked = late = 0
    for r in records:
        if not r.expect:
            continue
        kind = r.fault or "valid"
        by_fault[kind][r.ws or "none"] += 1
        if r.ending in UNJUDGED:
            continue
        checked += 1
        if r.ws.startswith("bad-"):
            bad.append(r)
        elif not ws_fits(r):
            if r.ending == "reset" and r.ws in ("eof", "none"):
                lost += 1  # the server reset the connection before its answer was read
            elif r.ws in ("eof", "none") and r.sent_after > handshake:
                late += 1  # the fuzzer was slower than the server's deadline, which closed it first
            else:
                wrong[kind].append(r)
        if r.echo in ("wrong", "short"):
            echoes.append(r)
    problems = []
    for kind, found in sorted(wrong.items(), key=lambda item: -len(item[1])):
        got = collections.Counter(r.ws for r in found)
        problems.append(
            f"{len(found):,} {kind} inputs got another answer than the fault warrants "
            f"({' or '.join(found[0].expect)}): {', '.join(f'{k} {n:,}' for k, n in got.most_common(4))} "
            f"(inputs {_samples(found)})"
        )
    if bad:
        kinds = collections.Counter(r.problem.split(":")[0] for r in bad)
        problems.append(
            f"{len(bad):,} connections got a handshake answer or a frame from the server that a client must refuse: "
            f"{'; '.join(f'{k} ({n:,})' for k, n in kinds.most_common(3))} (inputs {_samples(bad)})"
        )
    if echoes:
        short = sum(r.echo == "short" for r in echoes)
        problems.append(
            f"{len(echoes):,} echoes were not what was sent ({len(echoes) - short:,} other messages, "
            f"{short:,} fewer than sent) (inputs {_samples(echoes)})"
        )
    counts = {
        "ws_by_fault": {kind: dict(c.most_common(6)) for kind, c in sorted(by_fault.items())},
        "ws_checked": checked,
        "ws_mismatches": {kind: len(found) for kind, found in wrong.items()},
        "ws_reset_before_answer": lost,
        "ws_sent_late": late,
        "ws_bad_frames": len(bad),
        "echo": dict(collections.Counter(r.echo for r in records if r.echo)),
    }
    return problems, counts


def unclear(r: ConnRecord) -> bool:
    """Held open with no close although we half-closed it or left it to the server's
    timeouts, or stuck: no clear outcome."""
    return (r.ending == "open" and r.end in ("half-close", "wait")) or r.ending == "stuck"


def _per_input(rss: dict[str, float], start: str, end: str) -> float:
    """Bytes of RSS gained per input between two quiet points (0 if either is missing)."""
    span = rss.get(f"{end}_inputs", 0) - rss.get(f"{start}_inputs", 0)
    if span <= 0 or not rss.get(start) or not rss.get(end):
        return 0.0
    return (rss[end] - rss[start]) / span


def judge(obs: Observation, limits: Limits) -> Verdict:
    """The verdict on one run; see the module's docstring for the rules."""
    reasons: list[str] = []
    records = obs.records
    done = len(records)
    if obs.died:
        reasons.append(f"the server died during the run: {obs.died}")
    elif obs.exit_code != 0:
        reasons.append(f"the server exited with {obs.exit_code} when stopped by SIGTERM (expected 0)")
    faults = log_faults(obs.stderr)
    kinds = fault_summary(obs.stderr)
    if faults:
        shown = "; ".join(f"{n:,} x {kind}" for kind, n in kinds.most_common(4))
        reasons.append(f"{len(faults):,} fault lines (tracebacks, ERROR records) in the server's stderr: {shown}")
    if obs.timed_out:
        reasons.append(f"stopped at the time limit after {done:,} of {obs.requested:,} inputs")
    elif not obs.died and done < obs.requested:
        reasons.append(f"only {done:,} of {obs.requested:,} inputs were sent")

    counts: dict[str, Any] = {"inputs": done}
    replies: collections.Counter[str] = collections.Counter()
    disconnects: collections.Counter[str] = collections.Counter()
    endings: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    held = collections.Counter[str]()
    stuck = 0
    unclear_indices: list[int] = []
    for r in records:
        replies[r.reply] += 1
        if r.disconnect:
            disconnects[r.disconnect] += 1
        endings[f"{r.end}: {r.ending}"] += 1
        statuses.update(str(s) for s in r.statuses)
        if r.ending == "open" and r.end in ("half-close", "wait"):
            held[r.end] += 1
        stuck += r.ending == "stuck"
        if unclear(r) or 500 in r.statuses:
            unclear_indices.append(r.index)
    held_total = sum(held.values())
    if (held_total or stuck) and limits.holds:
        counts["held_by_design"] = held_total + stuck
    elif held_total or stuck:
        what = (
            f"the server held {held_total:,} connections open for {limits.wait:g} s with no close "
            f"({held['half-close']:,} half-closed by us, {held['wait']:,} left to its timeouts)"
        )
        if stuck:
            what += f", and stopped reading {stuck:,} before their input was sent"
        replayed = obs.replayed or []
        again = [r.index for r in replayed if unclear(r)]
        if not replayed or again:
            if replayed:
                what += (
                    f"; sent again alone to the idle server, {len(again)} of {len(replayed)} were: inputs {again[:10]}"
                )
            reasons.append(what)
        else:
            # Every one closed in time when sent alone: the server was late under the load.
            counts["late_under_load"] = held_total + stuck
            counts["replayed_alone"] = len(replayed)
    counts.update(replies=_top(replies, 20), endings=_top(endings, 20), unclear_samples=sorted(unclear_indices)[:50])
    if disconnects:
        counts["disconnects"] = _top(disconnects, 20)
    unparsed = sum(1 for r in records if r.reply.endswith("-malformed") or r.disconnect == "malformed")
    if unparsed:
        reasons.append(f"{unparsed:,} connections got a 5.0 CONNACK or DISCONNECT from the server that does not parse")
    if statuses.get("500"):
        reasons.append(f"{statuses['500']:,} responses were 500 (the server failed, not the client)")
    failed = sum(n for key, n in endings.items() if key.endswith(": connect-failed"))
    if done and failed / done > limits.connect_failures:
        reasons.append(f"{failed:,} of {done:,} connects failed")

    if obs.protocol == "http":
        counts["statuses"] = _top(statuses, 20)
    if any(r.expect for r in records):
        problems, ws_counts = _ws_check(records, limits.handshake)
        reasons.extend(problems)
        counts.update(ws_counts)
    if obs.presence is not None:
        problems, presence_counts = _presence_check(obs, records)
        reasons.extend(problems)
        counts.update(presence_counts)

    canary = obs.canary
    if canary.false_offline:
        reasons.append(f"canary: false offline for {', '.join(canary.false_offline[:5])}")
    if obs.canary_prefix and obs.presence is not None:
        # The log's word too, in case the subscriber itself was cut off: a canary device
        # goes offline only by its own DISCONNECT at the end.
        logged = [
            f"{e.get('client_id')} ({e.get('reason')})"
            for e in obs.presence
            if e.get("status") == "offline"
            and str(e.get("client_id") or "").startswith(obs.canary_prefix)
            and e.get("reason") != "disconnect"
        ]
        if logged:
            reasons.append(f"canary: the presence log has it offline: {', '.join(logged[:5])}")
    reasons.extend(f"canary: {p}" for p in canary.problems)
    if canary.problem_count > len(canary.problems):
        reasons.append(f"canary: {canary.problem_count - len(canary.problems)} more problems")

    fds = obs.fds
    if not obs.died:
        if fds.get("after_run", 0) > fds.get("canary", 0):
            reasons.append(
                f"open files did not come back after the run: {fds['after_run']} against {fds['canary']} before it"
            )
        if fds.get("after_canary", 0) > fds.get("before", 0):
            reasons.append(
                f"open files did not come back at the end: {fds['after_canary']} against {fds['before']} at the start"
            )
    rss = obs.rss
    counts["rss_growth_per_input"] = round(_per_input(rss, "warm", "end"), 1)
    late = _per_input(rss, "mid", "end")
    counts["rss_growth_late_per_input"] = round(late, 1)
    if late > limits.rss_growth and rss["end"] - rss["mid"] > limits.rss_slack:
        reasons.append(
            f"RSS kept growing: {rss['mid'] / 2**20:.1f} -> {rss['end'] / 2**20:.1f} MiB over the second half "
            f"of the run, {late:,.0f} B per input (limit {limits.rss_growth:,.0f} beyond "
            f"{limits.rss_slack / 2**20:.0f} MiB)"
        )
    counts["crashes"] = 1 if obs.died else 0
    counts["fault_lines"] = len(faults)
    counts["faults"] = dict(kinds.most_common(20))
    counts["inputs_per_second"] = round(done / obs.fuzz_seconds, 1) if obs.fuzz_seconds > 0 else 0.0
    counts["server_cpu"] = round(obs.server_cpu, 2)
    return Verdict(not reasons, reasons, counts)


def suspects_at(
    records: Iterable[ConnRecord], when: float, named: Sequence[tuple[float | None, str]] = (), limit: int = 20
) -> list[int]:
    """Indices of the connections a fault logged at wall-clock ``when`` points at.

    First those whose peer the fault lines name (``named``, as :func:`.faults.fault_peers`
    gives them), in that order: the server said whose bytes it failed on. Of two
    connections from one port, the one whose span is nearer the naming line's time.
    Then those in flight at ``when``: begun by then (a log line's time is cut to the
    millisecond) and not over half a second before. Of those, the nearest first by
    their start or their end, whichever is nearer: a server fails on a connection's
    first bytes or closes it as it fails, and a connection begun after the fault
    cannot have caused it.
    """
    records = list(records)
    by_peer: dict[str, list[ConnRecord]] = collections.defaultdict(list)
    for r in records:
        if r.peer:
            by_peer[r.peer].append(r)
    out: list[int] = []
    for at, peer in named:
        t = when if at is None else at
        candidates = by_peer.get(peer)
        if candidates:
            r = min(candidates, key=lambda r: max(0.0, r.started - t, t - r.finished))
            if r.index not in out:
                out.append(r.index)
    chosen = set(out)
    near = [r for r in records if r.started <= when + 0.01 and r.finished >= when - 0.5 and r.index not in chosen]
    near.sort(key=lambda r: min(abs(r.started - when), abs(r.finished - when)))
    out += [r.index for r in near]
    return out[:limit]
