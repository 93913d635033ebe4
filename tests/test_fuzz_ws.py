"""WebSockets in ``python -m loadtest fuzz`` (issue 29): the frames as written and read
back, the corpus (valid by wsproto, the MQTT in binary frames), each fault mutator
refused by wsproto's own parser as RFC 6455 and RFC 7692 say (or breaking the
handshake rule it names), the shapes keeping the messages, the replies read as
strictly as a client must, the judge's per-input rules, and short runs of each new
target on both engines."""

from __future__ import annotations

import base64
import collections
import random
import re
import struct
import zlib
from typing import Any

import h11
import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, Pong, TextMessage
from wsproto.extensions import Extension, PerMessageDeflate

from loadtest import fuzz
from loadtest.fuzz.cases import make_case
from loadtest.fuzz.corpus import END_MODES
from loadtest.fuzz.corpus_ws import echo_session, messages_of, mqtt_ws_session, served
from loadtest.fuzz.faults import fault_summary, first_fault, log_faults
from loadtest.fuzz.judge import Limits, judge
from loadtest.fuzz.mutators_ws import ANY, MQTT_WS_FAULTS, SERVED, WS_FAULTS, WS_SHAPES, WsFault
from loadtest.fuzz.mutators_ws_framing import MAX_SIZE
from loadtest.fuzz.observation import CanaryReport, ConnRecord, Observation
from loadtest.fuzz.replies import ws_reply
from loadtest.fuzz.runner import FuzzOptions
from loadtest.fuzz.targets import mqtt_ws_spec, ws_spec
from loadtest.fuzz.ws_frames import BINARY, CLOSE, PING, RSV1, TEXT, Frame, deflate, encode, parse
from servers.heartbeat.mqtt.reader import PacketReader

SEEDS = range(40)
CLOSE_CODES = {"close-1002", "close-1003", "close-1007", "close-1009"}
"""The codes RFC 6455 gives the faults: protocol error, data of a type not taken, invalid payload, too big."""


def session(seed: int, negotiated: bool | None = None) -> tuple[list[bytes], bool]:
    """An echo session (with compression agreed or not, if asked), by seed."""
    for k in range(200):
        _, segments, agreed = echo_session(random.Random(f"{seed}/{k}"))
        if negotiated is None or agreed == negotiated:
            return segments, agreed
    raise AssertionError("no such session")


def offer_of(handshake: bytes) -> str | None:
    m = re.search(rb"(?im)^sec-websocket-extensions: *([^\r\n]*)", handshake)
    return m.group(1).decode() if m else None


def server_events(segments: list[bytes], negotiated: bool) -> list[Event]:
    """What wsproto's server side makes of the frames (its permessage-deflate agreed as offered)."""
    extensions: list[Extension] = []
    offer = offer_of(segments[0])
    if negotiated and offer is not None:
        extension = PerMessageDeflate()
        assert extension.accept(offer) is not None
        extensions.append(extension)
    conn = Connection(ConnectionType.SERVER, extensions)
    conn.receive_data(b"".join(segments[1:]))
    return list(conn.events())


def whole(events: list[Event]) -> list[str | bytes]:
    """The messages in wsproto's events, joined from their pieces."""
    out: list[str | bytes] = []
    parts: list[Any] = []
    for event in events:
        if isinstance(event, TextMessage | BytesMessage):
            parts.append(event.data)
            if event.message_finished:
                out.append("".join(parts) if isinstance(event, TextMessage) else b"".join(bytes(p) for p in parts))
                parts = []
    return out


# -- frames ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 5, 125, 126, 1000, 65535, 65536, 70000])
def test_a_frame_reads_back_as_written(size: int) -> None:
    payload = random.Random(size).randbytes(size)
    for frame in (
        Frame(BINARY, payload, mask=b"abcd"),
        Frame(TEXT, payload, fin=False, rsv=RSV1, mask=None),
        Frame(PING, payload[:125], mask=b"\x00\x00\x00\x00"),
    ):
        assert parse(encode(frame)) == frame
    assert parse(encode(Frame(BINARY, payload)) + b"x") is None  # not exactly one frame
    lied = encode(Frame(BINARY, payload, length=size + 1))
    assert parse(lied) is None and len(lied) < size + 20


def test_non_minimal_lengths_are_written_as_asked() -> None:
    assert encode(Frame(BINARY, b"ab", mask=None, form="16"))[:4] == b"\x82\x7e\x00\x02"
    assert encode(Frame(BINARY, b"ab", mask=None, form="64"))[:10] == b"\x82\x7f" + struct.pack("!Q", 2)
    assert parse(encode(Frame(BINARY, b"ab", form="64"))) == Frame(BINARY, b"ab", form="64")


# -- the corpus ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_an_echo_session_is_valid_websocket(seed: int) -> None:
    _, segments, negotiated = echo_session(random.Random(seed))
    h = h11.Connection(h11.SERVER)
    h.receive_data(segments[0])
    request = h.next_event()
    assert isinstance(request, h11.Request) and request.method == b"GET"
    headers = {k.lower(): v for k, v in request.headers}
    assert len(base64.b64decode(headers[b"sec-websocket-key"])) == 16
    events = server_events(segments, negotiated)
    closes = [e for e in events if isinstance(e, CloseConnection)]
    assert all(c.code not in (1002, 1007, 1009) for c in closes), closes
    assert whole(events) == messages_of(segments, negotiated)
    assert messages_of(segments, negotiated)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_mqtt_ws_session_carries_its_packets_in_binary_frames(seed: int) -> None:
    name, segments, applied = mqtt_ws_session(random.Random(seed), v5=False, benign=True)
    assert applied == () and b"Sec-WebSocket-Protocol: mqtt" in segments[0]
    events = server_events(segments, negotiated=False)
    assert not any(isinstance(e, CloseConnection | TextMessage) for e in events)
    mqtt = b"".join(bytes(e.data) for e in events if isinstance(e, BytesMessage))
    packets = PacketReader().feed(mqtt)
    assert type(packets[0]).__name__.lower() == "connect"
    assert len(packets) == name.count("+")  # ws+connect+...: one packet a name


# -- the faults, as wsproto reads them --------------------------------------------------------

_FRAME_FAULTS = sorted(
    name
    for name, fault in WS_FAULTS.items()
    if ANY not in fault.outcomes and not name.startswith("hs-") and name not in ("too-big", "deflate-bomb")
)


@pytest.mark.parametrize("name", _FRAME_FAULTS)
@pytest.mark.parametrize("negotiated", [False, True], ids=["plain", "deflate"])
def test_each_frame_fault_is_refused_by_wsproto_as_the_rfc_says(name: str, negotiated: bool) -> None:
    fault = WS_FAULTS[name]
    expected = fault.expected(negotiated)
    seen: collections.Counter[str] = collections.Counter()
    for seed in SEEDS:
        segments, _ = session(seed, negotiated)
        mutated = fault.mutator(random.Random(seed), segments)
        assert mutated != segments, f"{name} left session {seed} as it was"
        events = server_events(mutated, negotiated)
        close = next((e for e in events if isinstance(e, CloseConnection)), None)
        if SERVED in expected:
            # No fault in it: wsproto takes what came (a close is the client's own).
            assert close is None or f"close-{close.code}" in served("ws", "half-close", mutated), (seed, close)
            assert whole(events) == messages_of(mutated, negotiated)
            seen[SERVED] += 1
            continue
        assert close is not None, f"{name}, session {seed}: wsproto took it"
        code = f"close-{close.code}"
        seen[code] += 1
        if name == "interleaved-data" and negotiated and code == "close-1007":
            continue  # wsproto's inflater ends the open message first: see tests/test_fuzz_ws_findings.py
        assert code in expected, (seed, close.code, close.reason)
    assert set(seen) & (set(expected) | {SERVED})


def _inflated_past_the_bound(segments: list[bytes]) -> bool:
    """Whether the data frames hold a message past :data:`MAX_SIZE`, inflated if compressed
    (wsproto has no bound of its own: the size is the server's check)."""
    size, compressed = 0, b""
    for s in segments[1:]:
        frame = parse(s)
        if frame is None:
            size += len(s)  # a frame declaring more than comes: its bytes count as they arrive
        elif frame.opcode in (0, TEXT, BINARY):
            if frame.rsv & RSV1 or compressed:
                compressed += frame.payload
                if frame.fin:
                    size += len(zlib.decompressobj(-15).decompress(compressed + b"\x00\x00\xff\xff"))
                    compressed = b""
            else:
                size += len(frame.payload)
        if size > MAX_SIZE:
            return True
    return False


@pytest.mark.parametrize("name", ["too-big", "deflate-bomb"])
def test_the_size_faults_go_past_the_bound(name: str) -> None:
    for seed in SEEDS:
        segments, _ = session(seed, negotiated=True)
        mutated = WS_FAULTS[name].mutator(random.Random(seed), segments)
        assert _inflated_past_the_bound(mutated), seed
        if name == "deflate-bomb":
            assert len(b"".join(mutated)) < 64 * 1024  # a few kilobytes on the wire
        # Where compression was not agreed, the RSV1 alone is the fault.
        if name == "deflate-bomb":
            close = next(e for e in server_events(mutated, False) if isinstance(e, CloseConnection))
            assert close.code == 1002


def test_a_text_frame_on_mqtt_reaches_wsproto_as_text() -> None:
    for seed in SEEDS:
        _, segments, _ = mqtt_ws_session(random.Random(seed), v5=False, benign=True)
        mutated = MQTT_WS_FAULTS["text-frame"].mutator(random.Random(seed), segments)
        events = server_events(mutated, negotiated=False)
        assert any(isinstance(e, TextMessage) for e in events), seed  # an MQTT server must close 1003


def rfc_handshake_problems(head: bytes, mqtt: bool) -> set[str]:
    """What an opening handshake breaks of RFC 6455 §4.1-4.2.1 (and, for MQTT, of the
    fuzz run's listener: its path, the mqtt subprotocol, the allowed Origin)."""
    problems = set()
    h = h11.Connection(h11.SERVER)
    h.receive_data(head)
    try:
        request = h.next_event()
    except h11.RemoteProtocolError:
        return {"not HTTP/1.1 as h11 reads it"}
    assert isinstance(request, h11.Request)
    if request.method != b"GET" or request.http_version != b"1.1":
        problems.add("method")
    headers = collections.defaultdict(list)
    for name, value in request.headers:
        headers[name.lower()].append(value)
    keys = headers[b"sec-websocket-key"]
    try:
        if len(keys) != 1 or len(base64.b64decode(keys[0], validate=True)) != 16:
            problems.add("key")
    except ValueError:
        problems.add("key")
    if headers[b"sec-websocket-version"] != [b"13"]:
        problems.add("version")
    if b"upgrade" not in {t.strip().lower() for v in headers[b"connection"] for t in v.split(b",")}:
        problems.add("connection")
    if [v.lower() for v in headers[b"upgrade"]] != [b"websocket"]:
        problems.add("upgrade")
    if mqtt:
        if request.target.split(b"?")[0] != b"/mqtt":
            problems.add("path")
        offered = {t.strip() for v in headers[b"sec-websocket-protocol"] for t in v.split(b",")}
        if not offered & {b"mqtt", b"mqttv3.1"}:
            problems.add("subprotocol")
        if headers[b"origin"] and headers[b"origin"] != [b"http://allowed.fuzz"]:
            problems.add("origin")
    return problems


_HANDSHAKE_RULES = {
    "hs-key": "key",
    "hs-version": "version",
    "hs-connection": "connection",
    "hs-upgrade": "upgrade",
    "hs-method": "method",
    "hs-host": "not HTTP/1.1 as h11 reads it",
    "hs-path": "path",
    "hs-subprotocol": "subprotocol",
    "hs-origin": "origin",
}


@pytest.mark.parametrize("name", sorted(_HANDSHAKE_RULES))
def test_each_handshake_fault_breaks_the_rule_it_names(name: str) -> None:
    mqtt = name not in WS_FAULTS
    faults = MQTT_WS_FAULTS if mqtt else WS_FAULTS
    for seed in SEEDS:
        if mqtt:
            _, segments, _ = mqtt_ws_session(random.Random(seed), v5=False, benign=True)
        else:
            segments, _ = session(seed)
        assert rfc_handshake_problems(segments[0], mqtt) == set()
        mutated = faults[name].mutator(random.Random(seed), segments)
        assert mutated[1:] == segments[1:]
        assert rfc_handshake_problems(mutated[0], mqtt) == {_HANDSHAKE_RULES[name]}, (seed, mutated[0])


# -- the shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WS_SHAPES))
def test_each_shape_keeps_the_messages(name: str) -> None:
    mutator = WS_SHAPES[name][1]
    changed = 0
    for seed in SEEDS:
        segments, negotiated = session(seed)
        mutated = mutator(random.Random(seed), segments)
        changed += mutated != segments
        before, after = messages_of(segments, negotiated), messages_of(mutated, negotiated)
        if name == "utf8-split-valid":
            assert len(after) == len(before) + 1 and "𝄞" in "".join(m for m in after if isinstance(m, str))
        else:
            assert after == before, seed
        if not negotiated:
            # wsproto agrees (compressed messages with a control frame between their
            # fragments are another matter: see tests/test_fuzz_ws_findings.py).
            assert whole(server_events(mutated, negotiated)) == after
    assert changed >= len(SEEDS) // 2


# -- cases ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["ws", "mqtt-ws"])
def test_ws_cases_are_functions_of_seed_and_index_and_cover_every_fault(protocol: str) -> None:
    cases = [make_case(3, protocol, i) for i in range(3000)]
    assert cases[:100] == [make_case(3, protocol, i) for i in range(100)]
    faults = WS_FAULTS if protocol == "ws" else MQTT_WS_FAULTS
    drawn = collections.Counter(c.fault for c in cases)
    assert set(faults) <= set(drawn), set(faults) - set(drawn)
    assert {c.end for c in cases} == set(END_MODES)
    assert 0.2 < sum(c.await_reply for c in cases) / len(cases) < 0.4
    assert drawn[""] > 100  # valid input among the hostile, as a control
    if protocol == "mqtt-ws":
        assert drawn["mqtt"] > 500  # MQTT faults in valid frames
    for c in cases:
        assert c.expect, c.index
        for outcome in c.expect:
            assert (
                outcome in CLOSE_CODES
                or outcome in (ANY, "eof", "none")
                or re.fullmatch(r"close-\d{4}|http-\d{3}", outcome)
            ), outcome
        if c.fault in faults and ANY not in faults[c.fault].outcomes and SERVED not in faults[c.fault].outcomes:
            # A fault is answered by the code the RFC gives it, or an HTTP status.
            assert set(c.expect) <= CLOSE_CODES | {o for o in c.expect if o.startswith("http-")}, c


def test_served_follows_the_end_and_the_client_s_close() -> None:
    segments, _ = session(1)
    without = [s for s in segments if (parse(s) or Frame(TEXT, b"")).opcode != CLOSE]
    assert served("ws", "half-close", without) == ("eof",)
    assert served("ws", "wait", without) == ("close-1011",)
    closing = [*without, encode(Frame(CLOSE, struct.pack("!H", 4001)))]
    assert served("ws", "wait", closing) == ("close-4001",)
    assert set(served("mqtt-ws", "wait", closing)) == {"close-1000", "eof", "close-4001"}


def test_wait_cases_with_no_fault_must_have_every_message_echoed() -> None:
    cases = [make_case(5, "ws", i) for i in range(2000)]
    strict = [c for c in cases if c.echo_all]
    assert len(strict) > 20
    assert all(c.end == "wait" and c.expect == ("close-1011",) and c.messages is not None for c in strict)


# -- replies -------------------------------------------------------------------------------------

_101 = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"


def server_frame(opcode: int, payload: bytes, fin: bool = True, rsv: int = 0) -> bytes:
    return encode(Frame(opcode, payload, fin=fin, rsv=rsv, mask=None))


def test_ws_reply_names_the_answer() -> None:
    assert ws_reply(b"").outcome == "none"
    assert ws_reply(b"HTTP/1.1 426 Upgrade Required\r\n\r\n").outcome == "http-426"
    assert ws_reply(b"SSH-2.0\r\n").outcome == "http-garbage"
    got = ws_reply(_101 + b"\r\n" + server_frame(TEXT, "é".encode()) + server_frame(CLOSE, struct.pack("!H", 1002)))
    assert (got.outcome, got.messages) == ("close-1002", ("é",))
    assert ws_reply(_101 + b"\r\n" + server_frame(CLOSE, b"")).outcome == "close-1005"
    assert ws_reply(_101 + b"\r\n" + server_frame(BINARY, b"\x20\x02\x00\x00")[:3]).outcome == "eof"


@pytest.mark.parametrize(
    ("frames", "problem"),
    [
        (encode(Frame(BINARY, b"x", mask=b"abcd")), "masked"),
        (server_frame(0x3, b""), "out of place"),
        (server_frame(TEXT, b"\xff"), "not UTF-8"),
        (server_frame(PING, b"", fin=False), "bad control"),
        (server_frame(BINARY, b"x", rsv=RSV1), "reserved bits"),
        (server_frame(CLOSE, b"\x03"), "1-byte"),
        (server_frame(CLOSE, struct.pack("!H", 1005)), "may not send"),
        (server_frame(CLOSE, struct.pack("!H", 1000)) + server_frame(BINARY, b""), "after the close"),
    ],
)
def test_ws_reply_refuses_what_a_client_must(frames: bytes, problem: str) -> None:
    got = ws_reply(_101 + b"\r\n" + frames)
    assert got.outcome == "bad-frame" and problem in got.problem, got


def test_ws_reply_holds_the_server_to_the_window_it_agreed() -> None:
    block = random.Random(1).randbytes(1500)
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    payload = (compressor.compress(block + block) + compressor.flush(zlib.Z_SYNC_FLUSH))[:-4]
    head = _101 + b"Sec-WebSocket-Extensions: permessage-deflate; server_max_window_bits=%d\r\n\r\n"
    wide = ws_reply(head % 10 + server_frame(BINARY, payload, rsv=RSV1))
    assert wide.outcome == "bad-frame" and "10 window bits" in wide.problem
    assert ws_reply(head % 15 + server_frame(BINARY, payload, rsv=RSV1)).messages == (block + block,)
    assert ws_reply(_101 + b"\r\n" + server_frame(TEXT, b"x"), mqtt=True).outcome == "bad-frame"


# -- the judge -------------------------------------------------------------------------------------


def ws_observation(records: list[ConnRecord], **changes: Any) -> Observation:
    fields: dict[str, Any] = {
        "protocol": "ws",
        "target": "ws-dense",
        "requested": len(records),
        "records": records,
        "fuzz_seconds": 1.0,
        "stderr": "",
        "canary": CanaryReport("ws", clients=1, exchanges=10, probes=1),
        "fds": {"before": 10, "canary": 11, "after_run": 11, "after_canary": 10},
        "rss": {},
        "exit_code": 0,
    }
    fields.update(changes)
    return Observation(**fields)


def record(i: int, ws: str, expect: tuple[str, ...], fault: str = "unmasked", **changes: Any) -> ConnRecord:
    r = ConnRecord(i, "half-close", f"127.0.0.2:{4000 + i}", ws, "eof", ws=ws, fault=fault, expect=expect)
    for key, value in changes.items():
        setattr(r, key, value)
    return r


def test_the_judge_holds_each_input_to_its_fault() -> None:
    good = [record(i, "close-1002", ("close-1002",)) for i in range(20)]
    good.append(record(20, "close-4000", (ANY,), fault="bit-flip"))
    good.append(record(21, "none", ("close-1002",), ending="aborted"))  # reset by us: nothing to judge
    verdict = judge(ws_observation(good), Limits(wait=5.0))
    assert verdict.passed, verdict.reasons
    assert verdict.counts["ws_checked"] == 21
    assert verdict.counts["ws_by_fault"]["unmasked"] == {"close-1002": 20, "none": 1}

    wrong = [*good, record(30, "close-1000", ("close-1002",)), record(31, "eof", ("close-1007",), fault="x")]
    reasons = judge(ws_observation(wrong), Limits(wait=5.0)).reasons
    assert any(
        "1 unmasked inputs got another answer than the fault warrants (close-1002): close-1000 1" in r for r in reasons
    )
    assert any("(inputs 31)" in r for r in reasons)


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            record(0, "bad-frame", (ANY,), problem="a masked frame from the server"),
            "a masked frame from the server (1)",
        ),
        (record(0, "bad-handshake", ("eof",), problem="agreed to an offer"), "agreed to an offer (1)"),
        (record(0, "http-500", (ANY,)), "another answer"),
        (record(0, "close-1011", ("close-1011",), echo="short"), "1 fewer than sent"),
        (record(0, "close-1011", ("close-1011",), echo="wrong"), "1 other messages"),
    ],
)
def test_the_judge_fails_a_bad_answer_whatever_the_fault(bad: ConnRecord, expected: str) -> None:
    reasons = judge(ws_observation([bad]), Limits(wait=5.0)).reasons
    assert any(expected in r for r in reasons), reasons


def test_a_reset_that_lost_the_answer_is_counted_not_failed() -> None:
    lost = record(0, "eof", ("close-1002",), ending="reset")
    verdict = judge(ws_observation([lost]), Limits(wait=5.0))
    assert verdict.passed and verdict.counts["ws_reset_before_answer"] == 1


def test_an_input_sent_after_the_handshake_deadline_may_go_unanswered() -> None:
    late = record(0, "none", ("close-1002",), sent_after=1.4)
    verdict = judge(ws_observation([late]), Limits(wait=5.0, handshake=1.0))
    assert verdict.passed and verdict.counts["ws_sent_late"] == 1
    # In time, the same silence is a fault.
    assert not judge(ws_observation([record(0, "none", ("close-1002",), sent_after=0.2)]), Limits(wait=5.0)).passed


def test_an_exception_group_that_ends_a_server_is_a_fault() -> None:
    text = (
        "heartbeat worker 0: listening on 127.0.0.1:1\n"
        "  + Exception Group Traceback (most recent call last):\n"
        '  |   File "x.py", line 1, in <module>\n'
        "  | ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)\n"
        "  +-+---------------- 1 ----------------\n"
        "    | Traceback (most recent call last):\n"
        '    |   File "y.py", line 2, in f\n'
        "    | wsproto.utilities.LocalProtocolError: Event Pong cannot be sent\n"
        "    +------------------------------------\n"
    )
    assert len(log_faults(text)) == 1
    assert fault_summary(text) == {"wsproto.utilities.LocalProtocolError: Event Pong cannot be sent": 1}
    assert "Exception Group Traceback" in first_fault(text)


def test_every_fault_says_what_a_server_may_answer() -> None:
    for faults in (WS_FAULTS, MQTT_WS_FAULTS):
        for name, fault in faults.items():
            assert isinstance(fault, WsFault) and fault.weight > 0
            for outcomes in (fault.outcomes, fault.unnegotiated or ()):
                for outcome in outcomes:
                    assert outcome in CLOSE_CODES | {SERVED, ANY} or outcome.startswith("http-"), (name, outcome)


def test_a_compressed_message_reads_as_sent() -> None:
    for n in (0, 1, 100, 5000):
        text = ("é✓" * n).encode()
        assert zlib.decompressobj(-15).decompress(deflate(text) + b"\x00\x00\xff\xff") == text
        events = server_events(
            [
                b"GET / HTTP/1.1\r\nSec-WebSocket-Extensions: permessage-deflate\r\n\r\n",
                encode(Frame(TEXT, deflate(text), rsv=RSV1, mask=b"abcd")),
            ],
            negotiated=True,
        )
        assert whole(events) == [text.decode()]
        assert not any(isinstance(e, Ping | Pong) for e in events)


# -- runs against our servers -----------------------------------------------------------------------


def quick(target: str, engine: str, inputs: int = 300) -> dict[str, Any]:
    # Short waits at the quiet points and few replays: a held connection costs seconds, not a minute.
    options = FuzzOptions(
        inputs=inputs, seed=3, connections=64, max_seconds=120.0, quiet=True, quiet_timeout=3.0, replay_sample=10
    )
    spec = ws_spec(engine) if target == "ws" else mqtt_ws_spec(engine)
    return fuzz.run(spec, options)


# Each finding of these runs has a test of its own (tests/test_fuzz_ws_findings.py); with
# those fixed, a short run must pass outright.


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "engine"),
    [
        ("ws", "dense"),
        ("ws", "streams"),
        ("mqtt-ws", "dense"),
        ("mqtt-ws", "streams"),
    ],
)
@pytest.mark.bench
def test_a_short_run_passes(target: str, engine: str) -> None:
    run = quick(target, engine)
    assert run["reasons"] == [], run["reasons"]
    counts = run["counts"]
    assert counts["inputs"] == 300 and counts["crashes"] == 0
    # The canary never noticed: an echo client, or devices over WebSockets staying online.
    assert run["canary"]["exchanges"] > 10 and run["canary"]["probes"] >= 1
    if target == "mqtt-ws":
        assert run["canary"]["online_seen"] == 3 and not run["canary"]["false_offline"]
    # The faults were drawn and answered with the RFC's codes.
    by_fault = counts["ws_by_fault"]
    assert len(by_fault) > 30
    answered = collections.Counter(o for outcomes in by_fault.values() for o in outcomes)
    assert {"close-1002", "close-1007", "http-400"} <= set(answered)
    assert ("close-1003" in answered) == (target == "mqtt-ws")
    assert counts["ws_checked"] > 150
    assert run["result"] == "PASS"
