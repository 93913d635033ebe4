"""The inputs of ``python -m loadtest fuzz``: a seeded corpus of valid MQTT sessions and
HTTP requests, mutated, and how each is delivered. Pure: no I/O.

A :class:`Case` is a pure function of ``(seed, target, index)`` (:func:`.cases.make_case`),
so any input of a run can be rebuilt from the seed and its index, and a run's
reproducer is just those two numbers.

- **Corpus.** MQTT: a CONNECT (client id empty or from a small set, keep-alive,
  clean or persistent session, with or without a Will, username and password),
  then a few of SUBSCRIBE, UNSUBSCRIBE, PUBLISH at QoS 0/1/2 (some retained),
  the QoS acknowledgements, PINGREQ, and sometimes DISCONNECT; a share of the
  sessions (:data:`V5_SHARE` by default) are MQTT 5.0, with properties, reason
  codes and AUTH (:mod:`.corpus_v5`), and get the 5.0 mutators more often. HTTP: one to four
  pipelined requests: GET, HEAD, OPTIONS, POST with a Content-Length body or a
  chunked one (extensions, trailers), ``Expect: 100-continue``, absolute-form
  targets, HTTP/1.0, a varying set of headers.
- **Mutations** (:mod:`.mutators`): most inputs get one to three; a few are
  sent valid, as a control.
- **WebSockets.** The ``ws`` and ``mqtt-ws`` inputs, each carrying what the server
  may answer to it, are :mod:`.corpus_ws`'s (:func:`.cases.make_case` hands them on).
- **Delivery.** Mostly in one write; some split into pieces a few milliseconds
  apart (a packet across reads); some are a slow trickle of a *valid* prefix,
  bounded in pieces and time. Then the connection is half-closed (the server must
  see the end), left open for the server to close (its timeouts must), or reset.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from servers.heartbeat.mqtt import encoders

from .corpus_v5 import mqtt5_session
from .mutators import HTTP_MUTATORS, MQTT5_MUTATORS, MQTT_MUTATORS
from .segments import Mutator, Segments

__all__ = [
    "END_MODES",
    "PROTOCOLS",
    "V5_SHARE",
    "WS_PROTOCOLS",
    "Case",
    "http_requests",
    "plain_case",
    "mqtt_session",
    "mutate",
    "split_pieces",
    "trickle_pieces",
]

PROTOCOLS = ("mqtt", "http", "ws", "mqtt-ws")
WS_PROTOCOLS = ("ws", "mqtt-ws")
"""WebSocket echo to an ASGI app, and MQTT over WebSockets (:mod:`.corpus_ws`)."""
END_MODES = ("half-close", "wait", "abort")
"""After sending: half-close (``shutdown(SHUT_WR)``) and read until the server closes;
wait for the server to close (its own timeouts bound that); or reset at once."""

# Client ids: mostly the empty one (the server assigns an id and forgets it) and a
# small set, so devices take each other over and records do not pile up.
CLIENT_IDS = ("", "", "", "fuzz-0", "fuzz-1", "fuzz-2", "fuzz-3", "fuzz-4", "fuzz-5", "f" * 23, "fuzz/é", "fuzz-7")
HOSTILE_IDS = ("fuzz+1", "fuzz#2", "fuzz/cmd", "f" * 300)
"""Valid MQTT, refused or narrowed by the server (issue 33): wildcards in an id, a ``/``
that a pattern ACL must not widen, an id past ``--max-client-id``."""
TOPICS = ("fuzz/a/b", "fuzz/0/state", "fuzz/1/state", "fuzz/x", "fuzz/é/ü")
SERVER_TOPICS = ("$SYS/presence/fuzz-1", "$SYS/fuzz")
"""Topics only the server writes: a PUBLISH there is dropped, a Will there refuses the CONNECT."""
FILTERS = ("fuzz/+/state", "fuzz/a/#", "fuzz/a/b", "fuzz/x", "$SYS/presence/fuzz-1", "+/+/state", "fuzz/#", "#")
FILTER_WEIGHTS = (6, 4, 6, 4, 2, 2, 1, 0.3)

V5_SHARE = 0.2
"""MQTT inputs that are 5.0 sessions, by default (the rest 3.1.1, one in ten of those 3.1)."""

VALID_SHARE = 0.08
"""Inputs sent as the corpus made them: valid traffic among the hostile, as a control."""
TRICKLE_SHARE = 0.05
SPLIT_SHARE = 0.12
TRICKLE_MAX_PIECES = 12
TRICKLE_MAX_GAP = 0.12
"""A trickle sends at most this many pieces this far apart: at most ~1.3 s per input."""
END_WEIGHTS = (0.60, 0.25, 0.15)


@dataclass(frozen=True)
class Case:
    """One fuzz input: what to send on one connection, how, and how to end it."""

    index: int
    base: str
    """The corpus entry it came from (``connect+subscribe+publish1``, ``get+post-chunked``...)."""
    mutations: tuple[str, ...]
    """The mutators applied, in order (empty: sent valid)."""
    pieces: tuple[bytes, ...]
    """Written one after another, ``gap`` seconds apart."""
    gap: float
    end: str
    """One of :data:`END_MODES`."""
    fault: str = ""
    """WebSocket inputs: the one fault put in (:mod:`.mutators_ws`), ``mqtt`` for MQTT
    faults in valid frames, empty for a valid input."""
    expect: tuple[str, ...] = ()
    """WebSocket inputs: what the server may answer (``close-1002``, ``http-400``, ``eof``,
    ``any``...; :func:`~.replies.ws_reply` names the answer the same way)."""
    messages: tuple[str | bytes, ...] | None = None
    """WebSocket echo inputs: the messages sent, which must come back in order (None: not
    checked, the input being damaged beyond telling)."""
    echo_all: bool = False
    """Whether every one of :attr:`messages` must come back (a valid input the server
    keeps open until its ping timeout), or a first part of them may do."""
    await_reply: bool = False
    """Send the first piece (the opening handshake), wait for the server's answer, then
    the rest: as a browser does, where the others send their frames at once behind it."""
    deflate: bool | None = None
    """WebSocket inputs: whether the server must agree to the ``permessage-deflate``
    offered (RFC 7692 §7: it must decline a malformed offer); None: not checked."""

    @property
    def data(self) -> bytes:
        """Every byte the case sends."""
        return b"".join(self.pieces)

    def describe(self) -> dict[str, object]:
        """JSON-ready, with the bytes in hex: a reproducer."""
        return {
            "index": self.index,
            "base": self.base,
            "mutations": list(self.mutations),
            "end": self.end,
            "gap": self.gap,
            "pieces_hex": [p.hex() for p in self.pieces],
            **(
                {"fault": self.fault, "expect": list(self.expect), "await_reply": self.await_reply}
                if self.expect
                else {}
            ),
        }


# -- the corpus: valid inputs ------------------------------------------------------------


def _packet_id(rng: random.Random) -> int:
    return rng.randint(1, 0xFDFF)


def _mqtt_connect(rng: random.Random) -> tuple[str, bytes]:
    hostile = rng.random() < 0.05
    client_id = rng.choice(HOSTILE_IDS if hostile else CLIENT_IDS)
    name = "connect-hostile-id" if hostile else "connect"
    will_topic: str | None = None
    will_message: bytes | None = None
    will_qos = 0
    will_retain = False
    if rng.random() < 0.2:
        name += "-will"
        will_topic = rng.choice(SERVER_TOPICS) if rng.random() < 0.1 else f"fuzz/will/{rng.randrange(4)}"
        will_message = rng.randbytes(rng.randint(0, 16))
        will_qos = rng.randrange(3)
        will_retain = rng.random() < 0.1
    username = password = None
    if rng.random() < 0.2:
        name += "-auth"
        username = rng.choice(("fuzz", "", "üser"))
        password = rng.randbytes(rng.randint(0, 12)) if rng.random() < 0.7 else None
    level, protocol = 4, "MQTT"
    if rng.random() < 0.1:  # MQTT 3.1, which old devices still send
        name += "-31"
        level, protocol = 3, "MQIsdp"
    packet = encoders.encode_connect(
        client_id,
        protocol_level=level,
        protocol_name=protocol,
        keep_alive=rng.choice((1, 1, 1, 2, 2, 0, 30)),
        clean_session=rng.random() < 0.85,
        will_topic=will_topic,
        will_message=will_message,
        will_qos=will_qos,
        will_retain=will_retain,
        username=username,
        password=password,
    )
    return name, packet


def _mqtt_op(rng: random.Random) -> tuple[str, bytes]:
    r = rng.random()
    if r < 0.22:
        n = rng.randint(1, 3)
        filters = [(f, rng.randrange(3)) for f in rng.choices(FILTERS, FILTER_WEIGHTS, k=n)]
        return "subscribe", encoders.encode_subscribe(_packet_id(rng), filters)
    if r < 0.30:
        return "unsubscribe", encoders.encode_unsubscribe(_packet_id(rng), rng.sample(FILTERS[:6], rng.randint(1, 2)))
    if r < 0.70:
        qos = rng.choice((0, 0, 1, 2))
        packet = encoders.encode_publish(
            rng.choice(SERVER_TOPICS) if rng.random() < 0.03 else rng.choice(TOPICS),
            rng.randbytes(rng.randint(0, 64)),
            qos=qos,
            retain=rng.random() < 0.05,
            packet_id=_packet_id(rng) if qos else None,
        )
        return f"publish{qos}", packet
    if r < 0.82:
        kind = rng.choice(("puback", "pubrec", "pubrel", "pubcomp"))
        encode = {
            "puback": encoders.encode_puback,
            "pubrec": encoders.encode_pubrec,
            "pubrel": encoders.encode_pubrel,
            "pubcomp": encoders.encode_pubcomp,
        }[kind]
        return kind, encode(_packet_id(rng))
    return "pingreq", encoders.encode_pingreq()


def mqtt_session(rng: random.Random) -> tuple[str, Segments]:
    """A valid MQTT 3.1.1 session as a client sends it: CONNECT, a few packets, maybe DISCONNECT."""
    name, connect = _mqtt_connect(rng)
    names = [name]
    packets = [connect]
    for _ in range(rng.choice((0, 1, 1, 2, 2, 3, 4, 5))):
        op, packet = _mqtt_op(rng)
        names.append(op)
        packets.append(packet)
    if rng.random() < 0.35:
        names.append("disconnect")
        packets.append(encoders.encode_disconnect())
    return "+".join(names), packets


_PATHS = ("/", "/healthz", "/nope", "/echo", "/download?size={n}")
_HEADERS = (
    b"User-Agent: fuzz/1.0",
    b"Accept: */*",
    b"Accept-Encoding: gzip, deflate",
    b"Cache-Control: no-cache",
    b"X-Request-Id: {n}",
    b"Cookie: a=b; c=d",
    b"Authorization: Bearer abc.def",
    b'If-None-Match: "x"',
)


def _http_request(rng: random.Random, last: bool) -> tuple[str, bytes]:
    # HTTP/1.0 closes after its response, so only a last request may be one.
    version = b"HTTP/1.0" if last and rng.random() < 0.1 else b"HTTP/1.1"
    headers = [b"Host: fuzz.local"] if rng.random() < 0.95 or version == b"HTTP/1.1" else []
    for h in rng.sample(_HEADERS, rng.randint(0, 4)):
        headers.append(h.replace(b"{n}", str(rng.randrange(10**6)).encode()))
    if last and rng.random() < 0.3:
        headers.append(b"Connection: close")
    body = b""
    r = rng.random()
    if r < 0.40:
        method, name = b"GET", "get"
        target = rng.choice(_PATHS).replace("{n}", str(rng.randint(0, 3000))).encode()
    elif r < 0.47:
        method, name, target = b"HEAD", "head", b"/"
    elif r < 0.50:
        method, name, target = b"OPTIONS", "options", b"*"
    elif r < 0.55:
        method, name, target = b"GET", "get-absolute", b"http://fuzz.local/healthz"
    elif r < 0.80:
        method, name, target = b"POST", "post", b"/echo"
        body = rng.randbytes(rng.randint(0, 1500)) if rng.random() < 0.5 else b"x" * rng.randint(0, 1500)
        headers.append(b"Content-Length: %d" % len(body))
        if rng.random() < 0.1:
            name += "-expect"
            headers.append(b"Expect: 100-continue")
    else:
        method, name, target = b"POST", "post-chunked", b"/echo"
        headers.append(b"Transfer-Encoding: chunked")
        for _ in range(rng.randint(1, 4)):
            chunk = rng.randbytes(rng.randint(1, 300))
            ext = b";ext=1" if rng.random() < 0.1 else b""
            body += b"%x%s\r\n%s\r\n" % (len(chunk), ext, chunk)
        body += b"0\r\nX-Trailer: t\r\n\r\n" if rng.random() < 0.1 else b"0\r\n\r\n"
    head = method + b" " + target + b" " + version + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
    return name, head + body


def http_requests(rng: random.Random) -> tuple[str, Segments]:
    """One to four valid HTTP/1.x requests, pipelined on one connection."""
    n = rng.choices((1, 2, 3, 4), (60, 20, 12, 8))[0]
    names, requests = [], []
    for k in range(n):
        name, request = _http_request(rng, last=k == n - 1)
        names.append(name)
        requests.append(request)
    return "+".join(names), requests


# -- mutation and delivery ---------------------------------------------------------------


def mutate(
    rng: random.Random,
    segments: Sequence[bytes],
    mutators: dict[str, tuple[float, Mutator]],
    counts: Sequence[int] = (1, 1, 1, 2, 2, 3),
) -> tuple[Segments, tuple[str, ...]]:
    """As many mutators from ``mutators`` as one of ``counts`` says (one to three by
    default), each chosen by weight, applied in turn."""
    names = list(mutators)
    weights = [mutators[n][0] for n in names]
    applied = tuple(rng.choices(names, weights, k=rng.choice(counts)))
    out = list(segments)
    for name in applied:
        out = mutators[name][1](rng, out)
    return out, applied


def split_pieces(rng: random.Random, data: bytes) -> tuple[bytes, ...]:
    """``data`` cut in two to six pieces, at random places."""
    if len(data) < 2:
        return (data,)
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 5))))
    return tuple(data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True))


def trickle_pieces(rng: random.Random, data: bytes) -> tuple[bytes, ...]:
    """A prefix of ``data`` in 1 to 4-byte pieces, at most :data:`TRICKLE_MAX_PIECES` of them."""
    pieces: list[bytes] = []
    at = 0
    for _ in range(rng.randint(2, TRICKLE_MAX_PIECES)):
        if at >= len(data):
            break
        step = rng.randint(1, 4)
        pieces.append(data[at : at + step])
        at += step
    return tuple(pieces)


def plain_case(seed: int, protocol: str, index: int, v5_share: float = V5_SHARE) -> Case:
    """Input number ``index`` of a run with ``seed`` against a plain MQTT or HTTP server;
    of MQTT inputs, ``v5_share`` are 5.0 sessions. (:func:`.cases.make_case` takes any
    target, the WebSocket ones included.)"""
    if protocol not in PROTOCOLS or protocol in WS_PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS} but the WebSocket ones, not {protocol!r}")
    # A string seed is hashed with SHA-512 by random.Random: stable across processes and
    # Python runs (unlike hash()), and independent from one index to the next.
    rng = random.Random(f"{seed}/{protocol}/{index}")
    # Which MQTT inputs are 5.0 is drawn apart, so the 3.1.1 ones are what they were.
    v5 = protocol == "mqtt" and v5_share > 0 and random.Random(f"{seed}/{protocol}/{index}/v5").random() < v5_share
    if v5:
        base, segments = mqtt5_session(rng)
        mutators = MQTT5_MUTATORS
    else:
        base, segments = mqtt_session(rng) if protocol == "mqtt" else http_requests(rng)
        mutators = MQTT_MUTATORS if protocol == "mqtt" else HTTP_MUTATORS
    end = rng.choices(END_MODES, END_WEIGHTS)[0]
    r = rng.random()
    if r < TRICKLE_SHARE:
        # A valid prefix, a few bytes at a time: the server's deadlines must cut it.
        pieces = trickle_pieces(rng, b"".join(segments))
        return Case(index, base, ("trickle",), pieces, rng.uniform(0.03, TRICKLE_MAX_GAP), end)
    if r < TRICKLE_SHARE + VALID_SHARE:
        applied: tuple[str, ...] = ()
    else:
        segments, applied = mutate(rng, segments, mutators)
    data = b"".join(segments)
    if rng.random() < SPLIT_SHARE:
        return Case(index, base, applied, split_pieces(rng, data), rng.uniform(0.001, 0.01), end)
    return Case(index, base, applied, (data,), 0.0, end)
