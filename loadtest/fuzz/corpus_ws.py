"""The WebSocket inputs of ``python -m loadtest fuzz``: ``--target ws`` (an ASGI echo
app on ``servers.http``) and ``--target mqtt-ws`` (MQTT over WebSockets on the
heartbeat server). Pure: no I/O.

A :class:`~.corpus.Case` here is, as for the other targets, a pure function of
``(seed, target, index)`` (:func:`ws_case`), and carries what the server may answer
(:attr:`~.corpus.Case.expect`), so that every input is judged by itself.

- **Corpus.** An opening handshake (a key, version 13, a path; for the echo app, an
  offer of ``permessage-deflate`` in a share of them, some with a
  ``server_max_window_bits`` the server must keep to; for MQTT, the ``mqtt`` or
  ``mqttv3.1`` subprotocol and sometimes the allowed ``Origin``), then frames, masked
  with random keys: messages of text (ASCII and not), binary, empty, long-distance
  repeats that a compressor may reference; compressed when that was agreed; and
  sometimes a close with a valid code and reason. For MQTT: a session's packets
  (:mod:`.corpus`, :mod:`.corpus_v5`) in binary frames, one packet a frame, all in
  one, or cut across frames (MQTT-6.0.0-2).
- **Mutations.** Most inputs get up to two valid reshapings (:data:`~.mutators_ws.WS_SHAPES`)
  then one fault (:data:`~.mutators_ws.WS_FAULTS`), which decides the answer. For MQTT,
  :data:`MQTT_LEVEL_SHARE` of the inputs instead carry MQTT faults (the MQTT mutators)
  in valid frames; those with a WebSocket fault carry a session the server has no
  reason to end first (an empty client id, no DISCONNECT), so the fault is what it answers.
- **Delivery.** As for the other targets (one write, pieces, a slow trickle of a valid
  prefix; then half-close, wait or reset), and for :data:`AWAIT_SHARE` of them the
  handshake alone first, the frames once the server has answered it.
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from collections.abc import Sequence

from servers.heartbeat.mqtt import encoders

from .corpus import (
    END_MODES,
    END_WEIGHTS,
    SPLIT_SHARE,
    TRICKLE_MAX_GAP,
    TRICKLE_SHARE,
    VALID_SHARE,
    Case,
    mqtt_session,
    mutate,
    split_pieces,
    trickle_pieces,
)
from .corpus_v5 import mqtt5_session
from .mutators import MQTT5_MUTATORS, MQTT_MUTATORS
from .mutators_ws import ANY, MQTT_WS_FAULTS, MQTT_WS_SHAPES, SERVED, WS_FAULTS, WS_SHAPES, WsFault
from .mutators_ws_framing import MAX_SIZE
from .mutators_ws_handshake import ALLOWED_ORIGIN
from .segments import Segments
from .ws_frames import BINARY, CLOSE, CONTINUATION, CONTROL, RSV1, TEXT, Frame, deflate, encode, parse

__all__ = [
    "AWAIT_SHARE",
    "MQTT_LEVEL_SHARE",
    "MQTT_WS_PATH",
    "echo_session",
    "messages_of",
    "mqtt_ws_session",
    "served",
    "ws_case",
]

MQTT_WS_PATH = "/mqtt"
_ECHO_PATHS = ("/", "/echo", "/ws/chat?room=1", "/a/b")  # never /flood: the app floods there
DEFLATE_SHARE = 0.4
"""Echo inputs that offer ``permessage-deflate`` (the server takes any valid offer)."""
BOGUS_OFFER_SHARE = 0.05
"""Echo inputs whose offer the server must turn down, going on without compression."""
BOGUS_OFFERS = (
    "permessage-deflate; client_max_window_bits=99",  # an invalid value
    "permessage-deflate; server_max_window_bits=7",
    "permessage-deflate; x=1",  # a parameter not defined for an offer
    "permessage-deflate; server_no_context_takeover=1",  # a value where there is none
    "permessage-deflate; client_max_window_bits; client_max_window_bits",  # one parameter twice
    "x-fuzz-deflate",  # an extension it does not know
)
"""Offers RFC 7692 §7 says a server MUST decline (the last one it cannot but decline)."""
AWAIT_SHARE = 0.3
MQTT_LEVEL_SHARE = 0.35
TRICKLE_OUTCOMES = {
    # A head cut short: 408 at the header timeout, 400 at an EOF inside it, or a
    # silent close (the MQTT listener's CONNECT deadline covers the handshake).
    "ws": ("http-408", "http-400", "none"),
    "mqtt-ws": ("http-400", "none"),
}

_VALID_CLOSE_CODES = (1000, 1000, 1001, 1003, 1008, 1011, 3000, 3999, 4000, 4999)
_TEXTS = ("hello", "", "fuzz é ✓ 𝄞", "x" * 300, "日本語のテキスト", "a\x00b")


def _handshake(rng: random.Random, path: str, headers: Sequence[str]) -> bytes:
    key = base64.b64encode(rng.randbytes(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        "Host: 127.0.0.1",
        rng.choice(("Upgrade: websocket", "Upgrade: WebSocket")),
        rng.choice(("Connection: Upgrade", "Connection: keep-alive, Upgrade", "Connection: upgrade")),
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *headers,
    ]
    rng.shuffle(lines[1:])  # any order of headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _close(rng: random.Random) -> Frame:
    code = rng.choice(_VALID_CLOSE_CODES)
    reason = rng.choice((b"", b"bye", "au revoir é".encode()))
    payload = b"" if rng.random() < 0.1 else struct.pack("!H", code) + reason
    return Frame(CLOSE, payload, mask=rng.randbytes(4))


def _message(rng: random.Random) -> tuple[str, str | bytes]:
    r = rng.random()
    if r < 0.4:
        return "text", rng.choice(_TEXTS)
    if r < 0.75:
        return "binary", rng.randbytes(rng.choice((0, 1, 16, 125, 126, 1000, 2000)))
    # A block repeated more than 1 KiB back: a compressor keeping to a small window
    # must not reference it (server_max_window_bits).
    block = rng.randbytes(rng.randint(1100, 1800))
    return "repeat", block + block


def echo_session(rng: random.Random) -> tuple[str, Segments, bool]:
    """A valid WebSocket session to the echo app: its name, its segments (the
    handshake, then frames) and whether ``permessage-deflate`` is agreed."""
    headers = []
    names = ["ws"]
    if rng.random() < 0.3:
        headers.append("Sec-WebSocket-Protocol: " + rng.choice(("chat", "chat, superchat", "mqtt")))
    if rng.random() < 0.2:
        headers.append("Origin: http://page.fuzz")
    negotiated = False
    r = rng.random()
    if r < DEFLATE_SHARE:
        negotiated = True
        names.append("deflate")
        params = rng.choice(
            (
                "",
                "; client_max_window_bits",
                "; client_no_context_takeover",
                "; server_no_context_takeover",
                f"; server_max_window_bits={rng.randint(9, 15)}",
                f"; server_max_window_bits={rng.randint(9, 11)}; client_max_window_bits",
            )
        )
        headers.append("Sec-WebSocket-Extensions: permessage-deflate" + params)
    elif r < DEFLATE_SHARE + BOGUS_OFFER_SHARE:
        names.append("bogus-offer")
        headers.append("Sec-WebSocket-Extensions: " + rng.choice(BOGUS_OFFERS))
    frames = []
    for _ in range(rng.choice((1, 1, 2, 3, 5))):
        kind, message = _message(rng)
        payload = message.encode() if isinstance(message, str) else message
        frame = Frame(TEXT if isinstance(message, str) else BINARY, payload, mask=rng.randbytes(4))
        if negotiated and rng.random() < 0.5:
            kind += "-deflated"
            frame = Frame(frame.opcode, deflate(payload), rsv=RSV1, mask=frame.mask)
        names.append(kind)
        frames.append(frame)
    if rng.random() < 0.3:
        names.append("close")
        frames.append(_close(rng))
    handshake = _handshake(rng, rng.choice(_ECHO_PATHS), headers)
    return "+".join(names), [handshake, *(encode(f) for f in frames)], negotiated


def _benign_mqtt(rng: random.Random) -> tuple[str, Segments]:
    """MQTT packets the server has no reason to close on: an empty client id (nothing to
    take over), a CONNECT, then pings, publishes and a subscription; no DISCONNECT."""
    names = ["connect"]
    packets = [encoders.encode_connect("", keep_alive=rng.choice((1, 2, 30)))]
    for _ in range(rng.choice((0, 1, 2, 3))):
        r = rng.random()
        if r < 0.4:
            names.append("pingreq")
            packets.append(encoders.encode_pingreq())
        elif r < 0.8:
            names.append("publish0")
            packets.append(encoders.encode_publish("fuzz/ws", rng.randbytes(rng.randint(0, 200))))
        else:
            names.append("subscribe")
            packets.append(encoders.encode_subscribe(rng.randint(1, 0xFFFF), [("fuzz/ws/#", rng.randrange(2))]))
    return "+".join(names), packets


def _in_frames(rng: random.Random, packets: Sequence[bytes]) -> list[Frame]:
    """MQTT bytes in binary frames: a packet a frame, all in one, or cut anywhere (a
    packet across frames, several in one: MQTT-6.0.0-2)."""
    data = b"".join(packets)
    r = rng.random()
    if r < 0.5:
        chunks: Sequence[bytes] = packets
    elif r < 0.7:
        chunks = [data]
    else:
        chunks = split_pieces(rng, data)
    return [Frame(BINARY, chunk, mask=rng.randbytes(4)) for chunk in chunks]


def mqtt_ws_session(rng: random.Random, v5: bool, benign: bool) -> tuple[str, Segments, tuple[str, ...]]:
    """An MQTT session over a WebSocket: its name, its segments (the handshake, then
    frames) and the MQTT mutators applied to its packets (``benign``: none, and a
    session the server has no reason to end)."""
    applied: tuple[str, ...] = ()
    if benign:
        name, packets = _benign_mqtt(rng)
    else:
        name, packets = mqtt5_session(rng) if v5 else mqtt_session(rng)
        if rng.random() < 0.8:
            packets, applied = mutate(rng, packets, MQTT5_MUTATORS if v5 else MQTT_MUTATORS)
    headers = ["Sec-WebSocket-Protocol: " + rng.choice(("mqtt", "mqtt", "mqttv3.1", "mqtt, mqttv3.1"))]
    if rng.random() < 0.2:
        headers.append("Origin: " + ALLOWED_ORIGIN.decode())
    if rng.random() < 0.2:
        headers.append("Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits")  # never taken
    path = MQTT_WS_PATH + ("?client=fuzz" if rng.random() < 0.1 else "")
    frames = _in_frames(rng, packets)
    if not benign and rng.random() < 0.15:
        name += "+close"
        frames.append(_close(rng))
    return "ws+" + name, [_handshake(rng, path, headers), *(encode(f) for f in frames)], applied


# -- what the server may answer ------------------------------------------------------------


def _client_close(segments: Sequence[bytes]) -> int | None:
    """The code of the first close frame among the segments (1005 for none given)."""
    for s in segments[1:]:
        frame = parse(s)
        if frame is not None and frame.opcode == CLOSE and frame.mask is not None:
            return struct.unpack("!H", frame.payload[:2])[0] if len(frame.payload) >= 2 else 1005
    return None


def served(protocol: str, end: str, segments: Sequence[bytes]) -> tuple[str, ...]:
    """What a server answers to an input it finds no fault in: an echo of the client's
    close, else the end of the connection as it comes (the client's EOF at a
    half-close; the ping timeout's 1011 on the echo server, or, for MQTT, its keep-alive
    or CONNECT deadline, which may say 1000 first)."""
    code = _client_close(segments)
    if protocol == "ws":
        if code is not None:
            return (f"close-{code}",)
        return ("eof",) if end == "half-close" else ("close-1011",) if end == "wait" else ("eof", "close-1011")
    # The MQTT server may end the session first (a DISCONNECT, an MQTT fault): 1000 then.
    return ("close-1000", "eof") + ((f"close-{code}",) if code not in (None, 1000) else ())


def _inflate(data: bytes) -> bytes | None:
    try:
        return zlib.decompressobj(-15).decompress(data + b"\x00\x00\xff\xff")
    except zlib.error:
        return None


def messages_of(segments: Sequence[bytes], negotiated: bool) -> list[str | bytes]:
    """The messages a correct server takes from the segments, in order, up to the first
    frame it must refuse (or a close): what an echo app sends back."""
    out: list[str | bytes] = []
    parts: list[bytes] = []
    opcode: int | None = None
    compressed = False
    for s in segments[1:]:
        frame = parse(s)
        if frame is None or frame.mask is None or frame.length is not None or frame.form != "min":
            break
        allowed_rsv = RSV1 if negotiated and frame.opcode in (TEXT, BINARY) else 0
        if frame.rsv & ~allowed_rsv or frame.opcode not in (CONTINUATION, TEXT, BINARY, *CONTROL):
            break
        if frame.opcode in CONTROL:
            if frame.opcode == CLOSE or not frame.fin or len(frame.payload) > 125:
                break
            continue
        if (frame.opcode == CONTINUATION) != (opcode is not None):
            break  # a continuation with no message open, or a new message inside one
        if opcode is None:
            opcode, compressed = frame.opcode, bool(frame.rsv & RSV1)
        parts.append(frame.payload)
        if not frame.fin:
            continue
        data = _inflate(b"".join(parts)) if compressed else b"".join(parts)
        if data is None or len(data) > MAX_SIZE:
            break
        if opcode == TEXT:
            try:
                out.append(data.decode())
            except UnicodeDecodeError:
                break
        else:
            out.append(data)
        parts, opcode = [], None
    return out


# -- a case --------------------------------------------------------------------------------


def _pick(rng: random.Random, entries: dict[str, WsFault]) -> str:
    names = list(entries)
    return rng.choices(names, [entries[n].weight for n in names])[0]


def ws_case(seed: int, protocol: str, index: int, v5_share: float) -> Case:
    """Input number ``index`` of a run with ``seed`` against a WebSocket ``protocol``
    (``ws`` or ``mqtt-ws``, where ``v5_share`` of the MQTT sessions are 5.0)."""
    rng = random.Random(f"{seed}/{protocol}/{index}")
    negotiated = False
    mqtt_level = False
    mqtt_applied: tuple[str, ...] = ()
    if protocol == "ws":
        base, segments, negotiated = echo_session(rng)
        faults, shapes = WS_FAULTS, WS_SHAPES
    else:
        v5 = v5_share > 0 and random.Random(f"{seed}/{protocol}/{index}/v5").random() < v5_share
        mqtt_level = rng.random() < MQTT_LEVEL_SHARE
        base, segments, mqtt_applied = mqtt_ws_session(rng, v5, benign=not mqtt_level)
        faults, shapes = MQTT_WS_FAULTS, MQTT_WS_SHAPES
    end = rng.choices(END_MODES, END_WEIGHTS)[0]
    r = rng.random()
    if r < TRICKLE_SHARE:
        # A valid prefix of the handshake, a few bytes at a time: the head's deadline must cut it.
        pieces = trickle_pieces(rng, b"".join(segments))
        gap = rng.uniform(0.03, TRICKLE_MAX_GAP)
        return Case(index, base, ("trickle",), pieces, gap, end, "trickle", TRICKLE_OUTCOMES[protocol])
    reshaped, shaped = mutate(rng, segments, shapes, counts=(0, 0, 1, 1, 2))
    segments, applied = reshaped, list(shaped)
    fault = "mqtt" if mqtt_applied else ""
    expect: tuple[str, ...] = (SERVED,)
    if not mqtt_level and r >= TRICKLE_SHARE + VALID_SHARE:
        fault = _pick(rng, faults)
        segments = faults[fault].mutator(rng, segments)
        expect = faults[fault].expected(negotiated)
        applied.append(fault)
    messages = None
    if protocol == "ws" and ANY not in expect:
        messages = tuple(messages_of(segments, negotiated))
    # Every message must come back where nothing ends the WebSocket before the ping timeout.
    echo_all = messages is not None and expect == (SERVED,) and end == "wait" and _client_close(segments) is None
    if SERVED in expect:
        expect = tuple(e for e in expect if e != SERVED) + served(protocol, end, segments)
    mutations = (*mqtt_applied, *applied)
    # Blind damage may have broken the offer itself.
    deflate = None if ANY in expect else negotiated

    def case(pieces: tuple[bytes, ...], gap: float = 0.0, await_reply: bool = False) -> Case:
        return Case(index, base, mutations, pieces, gap, end, fault, expect, messages, echo_all, await_reply, deflate)

    if rng.random() < AWAIT_SHARE:
        rest = b"".join(segments[1:])
        return case((segments[0], rest) if rest else (segments[0],), await_reply=True)
    data = b"".join(segments)
    if rng.random() < SPLIT_SHARE:
        return case(split_pieces(rng, data), rng.uniform(0.001, 0.01))
    return case((data,))
