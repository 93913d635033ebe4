"""Judging a fuzz run: what each connection saw, what the server wrote, and the verdict. Pure.

The runner (:mod:`.fuzz_runner`) collects an :class:`Observation`; :func:`judge` turns
it into a :class:`Verdict`. A run passes only if every one of these holds:

- the server process was alive throughout and exited 0 when stopped by SIGTERM;
- its stderr holds no traceback and no ERROR or CRITICAL record;
- every connection had a clear outcome: the server answered (a CONNACK refusal
  code, an HTTP status) and/or closed it, or we reset it ourselves. A connection
  we half-closed, or left to the server's own timeouts, must have been closed by
  the server within its longest timeout plus a margin. HTTP 500 is a server fault;
- MQTT: every connection's end is in the presence log, with its reason (a protocol
  error names which one);
- the canary stayed healthy: no false offline, every ping answered, every HTTP
  request 200, and the server kept accepting new connections;
- the server's open files came back to what they were before the run (no leaked
  sockets), and its RSS did not keep growing with the inputs through the second half
  of the run (taken each time with the server idle);
- the run did every input it was asked for, within its time limit.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .qos import frames

__all__ = [
    "CanaryReport",
    "ConnRecord",
    "Limits",
    "Observation",
    "Verdict",
    "fault_summary",
    "first_fault",
    "http_statuses",
    "judge",
    "log_faults",
    "mqtt_reply",
    "suspects_at",
    "unclear",
]

ENDINGS = ("eof", "reset", "open", "cut", "aborted", "stuck", "connect-failed")
"""How a connection ended, as the client saw it: the server closed it (``eof``) or reset
it; it was still ``open`` when we stopped waiting; we stopped reading a large response
(``cut``); we reset it ourselves right after sending (``aborted``); the server stopped
reading what we sent and never closed (``stuck``); or it never opened."""

_PACKET_NAMES = {
    0x2: "connack",
    0x3: "publish",
    0x4: "puback",
    0x5: "pubrec",
    0x6: "pubrel",
    0x7: "pubcomp",
    0x9: "suback",
    0xB: "unsuback",
    0xD: "pingresp",
}


@dataclass(slots=True)
class ConnRecord:
    """One fuzz connection, as the client saw it."""

    index: int
    """The case's index (rebuild it with :func:`~.fuzz_corpus.make_case`)."""
    end: str
    """The case's end mode: half-close, wait or abort."""
    peer: str
    """Our address as the server sees it (``host:port``); empty if the connect failed."""
    reply: str
    """MQTT: ``connack-<rc>``, the first packet's type, or ``none``; HTTP: the first status, or ``none``."""
    ending: str
    """One of :data:`ENDINGS`."""
    statuses: tuple[int, ...] = ()
    """HTTP: every status read."""
    received: int = 0
    started: float = 0.0
    """Wall-clock time the connection began (for matching a log line's time)."""
    finished: float = 0.0


def mqtt_reply(data: bytes) -> str:
    """What the server's first packet was: ``connack-<rc>``, another type's name, or ``none``."""
    try:
        found, _ = frames(data)
    except ValueError:
        return "malformed"
    if not found:
        return "none" if not data else "partial"
    first, start, end = found[0]
    kind = first >> 4
    if kind == 0x2 and end - start == 2:
        return f"connack-{data[start + 1]}"
    return _PACKET_NAMES.get(kind, f"type-{kind}")


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n")


def http_statuses(data: bytes) -> tuple[int, ...]:
    """The status of every response in ``data``, framed by Content-Length or chunked
    encoding; a body that does not frame (a HEAD's, say) is skipped by looking for the
    next status line after the head."""
    out: list[int] = []
    pos = 0
    while pos < len(data):
        m = _STATUS_LINE.match(data, pos)
        if m is None:
            nxt = _STATUS_LINE.search(data, pos)
            if nxt is None:
                break
            m = nxt
        status = int(m.group(1))
        out.append(status)
        head_end = data.find(b"\r\n\r\n", m.start())
        if head_end < 0:
            break
        head = data[m.start() : head_end].lower()
        body = head_end + 4
        if status < 200 or status in (204, 304):
            pos = body
            continue
        length = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
        if length is not None:
            pos = body + int(length.group(1))
            if not data.startswith(b"HTTP/1.", pos):
                pos = body  # no body after all (a HEAD's): look again from the head's end
        elif b"transfer-encoding: chunked" in head:
            pos = _skip_chunked(data, body)
        else:
            break  # a body until close: nothing else follows
    return tuple(out)


def _skip_chunked(data: bytes, pos: int) -> int:
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return len(data)
        try:
            size = int(data[pos:line_end].split(b";")[0], 16)
        except ValueError:
            return len(data)
        pos = line_end + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", pos - 2)
            return len(data) if end < 0 else end + 4
        pos += size + 2


_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (ERROR|CRITICAL) ")
_FAULT_MARKERS = ("Traceback (most recent call last)", "Exception ignored in", "Fatal Python error")


def log_faults(text: str) -> list[tuple[float | None, str]]:
    """Every line of a server's stderr that shows a fault: a traceback, a record at ERROR
    or CRITICAL (in the servers' ``%(asctime)s %(name)s %(levelname)s`` format), a
    fatal or ignored exception. Each with the time of the nearest record at or before
    it (None if there is none) and the line."""
    out: list[tuple[float | None, str]] = []
    last: float | None = None
    for line in text.splitlines():
        stamp = re.match(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if stamp is not None:
            last = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if _RECORD.match(line) or any(line.startswith(m) for m in _FAULT_MARKERS):
            out.append((last, line))
    return out


def fault_summary(text: str) -> collections.Counter[str]:
    """What went wrong, by kind: each traceback's exception line (the first unindented line
    after it), each ERROR or CRITICAL record's logger and message, each fatal or ignored
    exception; with how often each came."""
    out: collections.Counter[str] = collections.Counter()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith(_FAULT_MARKERS[0]):
            while i < len(lines) and (not lines[i] or lines[i][0].isspace()):
                i += 1
            if i < len(lines):
                out[lines[i][:200]] += 1
                i += 1
        elif _RECORD.match(line):
            out[line[24:224]] += 1  # without the time: one kind however often it came
        elif line.startswith(_FAULT_MARKERS[1:]):
            out[line[:200]] += 1
    return out


def first_fault(text: str, context: int = 60) -> str:
    """The lines around the first fault in a server's stderr (empty if there is none)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _RECORD.match(line) or line.startswith(_FAULT_MARKERS):
            return "\n".join(lines[max(0, i - 2) : i + context])
    return ""


@dataclass
class CanaryReport:
    """How the well-behaved clients fared beside the fuzzer."""

    kind: str
    """``mqtt``: devices pinging and a presence subscriber; ``http``: a keep-alive client."""
    clients: int = 0
    exchanges: int = 0
    """PINGREQ/PINGRESP round trips, or HTTP requests answered 200."""
    max_latency: float = 0.0
    max_gap: float = 0.0
    """The longest the canary's own loop was away (a pause of the canary process, not the server's)."""
    probes: int = 0
    """New connections opened to check the server still accepts (each must succeed)."""
    online_seen: int = 0
    """MQTT: canary devices the presence subscriber saw come online (all of them, or the check is void)."""
    false_offline: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """The first few problems, each with when it happened."""
    problem_count: int = 0

    def healthy(self) -> bool:
        """No problem and no false offline."""
        return not self.problems and not self.false_offline


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


@dataclass
class Observation:
    """Everything the runner saw of one run."""

    protocol: str
    target: str
    requested: int
    records: list[ConnRecord]
    fuzz_seconds: float
    stderr: str
    canary: CanaryReport
    fds: dict[str, int]
    """``before`` (no client), ``canary`` (its clients connected), ``after_run`` (the fuzz
    connections gone), ``after_canary`` (everything gone)."""
    rss: dict[str, float]
    """``warm``, ``mid`` and ``end``: RSS (bytes) once the server was idle after the warm-up
    (a tenth of the inputs), half-way through the rest, and after the run; ``warm_inputs``,
    ``mid_inputs`` and ``end_inputs``: inputs done by then."""
    exit_code: int | None
    """After SIGTERM; None if the server had already died."""
    died: str = ""
    """How and when the server died during the run, if it did."""
    timed_out: bool = False
    presence: list[dict[str, Any]] | None = None
    """MQTT: the presence log's events."""
    canary_peers: set[str] = field(default_factory=set)
    canary_prefix: str = ""
    """MQTT: the canary's client ids start with this (its offline events in the log are checked too)."""
    suspects: list[dict[str, Any]] = field(default_factory=list)
    """Reproducers of the inputs in flight when the server died or first logged a fault."""
    replayed: list[ConnRecord] | None = None
    """A sample of the connections held open (or stuck) during the run, sent again one
    at a time on the idle server after it: None if there was none, or no replay."""
    server_cpu: float = 0.0
    """The server's CPU over the run, in cores (1.0: one core busy all the time)."""


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
        and r.reply != "connack-0"
        and reason_of.get(r.peer) not in ("refused", "protocol-error")
    )
    # Of the peers short of ends, how many connections had been accepted (CONNACK 0 read).
    short = {peer for peer, n in ours.items() if by_peer.get(peer, 0) < n}
    accepted = sum(1 for r in records if r.peer in short and r.reply == "connack-0")
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
    endings: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    held = collections.Counter[str]()
    stuck = 0
    unclear_indices: list[int] = []
    for r in records:
        replies[r.reply] += 1
        endings[f"{r.end}: {r.ending}"] += 1
        statuses.update(str(s) for s in r.statuses)
        if r.ending == "open" and r.end in ("half-close", "wait"):
            held[r.end] += 1
        stuck += r.ending == "stuck"
        if unclear(r) or 500 in r.statuses:
            unclear_indices.append(r.index)
    held_total = sum(held.values())
    if held_total or stuck:
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
    if statuses.get("500"):
        reasons.append(f"{statuses['500']:,} responses were 500 (the server failed, not the client)")
    failed = sum(n for key, n in endings.items() if key.endswith(": connect-failed"))
    if done and failed / done > limits.connect_failures:
        reasons.append(f"{failed:,} of {done:,} connects failed")

    if obs.protocol == "http":
        counts["statuses"] = _top(statuses, 20)
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


def suspects_at(records: Iterable[ConnRecord], when: float, limit: int = 20) -> list[int]:
    """Indices of the connections open at wall-clock ``when`` (the nearest first)."""
    near = [r for r in records if r.started - 0.5 <= when <= r.finished + 0.5]
    near.sort(key=lambda r: abs(r.started - when))
    return [r.index for r in near[:limit]]
