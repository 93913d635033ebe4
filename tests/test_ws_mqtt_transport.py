"""MQTT over WebSockets, sans-IO (issue 29, the transport under both servers): the
opening handshake's policy (path, subprotocol, Origin), binary frames only, packets
across frames and several in one, pings, closes and broken frames. The client side
is wsproto's own client connection, or raw bytes where a client would misbehave."""

from __future__ import annotations

import itertools
import os

from hypothesis import given
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.reader import PacketReader
from servers.ws.handshake import WsPolicy
from servers.ws.mqtt_transport import MAX_HEAD, MqttOverWs

CONNECT = encoders.encode_connect("ws-device", keep_alive=30)
PINGREQ = b"\xc0\x00"


def client(
    target: str = "/mqtt", subprotocols: tuple[str, ...] = ("mqtt",), origin: str | None = None
) -> tuple[WSConnection, bytes]:
    """A wsproto client and its opening handshake's bytes."""
    ws = WSConnection(ConnectionType.CLIENT)
    headers = [] if origin is None else [(b"Origin", origin.encode())]
    return ws, ws.send(Request(host="127.0.0.1", target=target, subprotocols=list(subprotocols), extra_headers=headers))


def answer(ws: WSConnection, out: bytes) -> list[object]:
    ws.receive_data(out)
    return list(ws.events())


def opened(policy: WsPolicy | None = None) -> tuple[MqttOverWs, WSConnection]:
    server = MqttOverWs(policy or WsPolicy())
    ws, hello = client(subprotocols=("mqttv3.1", "mqtt"))
    step = server.receive(hello)
    assert step.ended is None and step.mqtt == b""
    assert answer(ws, step.out) == [AcceptConnection(subprotocol="mqtt")]  # preferred, whatever the order offered
    assert server.subprotocol == "mqtt" and server.open
    return server, ws


def test_the_handshake_names_the_subprotocol_on_the_wire() -> None:
    server = MqttOverWs(WsPolicy())
    _, hello = client(subprotocols=("mqttv3.1",))
    out = server.receive(hello).out
    assert out.startswith(b"HTTP/1.1 101 ") and b"\r\nsec-websocket-protocol: mqttv3.1\r\n" in out.lower()
    assert server.subprotocol == "mqttv3.1"


def test_refusals_say_why() -> None:
    policy = WsPolicy(allowed_origins=frozenset({"https://dash.example.com"}))
    cases = [
        ("/other", ("mqtt",), None, 404, "path '/other'"),
        ("/mqtt", ("mqtt",), "https://evil.example.net", 403, "origin 'https://evil.example.net' is not allowed"),
        ("/mqtt", ("chat",), None, 400, "subprotocols offered: chat"),
        ("/mqtt", (), None, 400, "subprotocols offered: none"),
    ]
    for target, offered, origin, status, why in cases:
        server = MqttOverWs(policy)
        ws, hello = client(target, offered, origin)
        step = server.receive(hello)
        assert step.ended is not None and f"({status})" in step.ended and why in step.ended, step.ended
        reply = answer(ws, step.out)[0]
        assert isinstance(reply, RejectConnection) and reply.status_code == status
        assert server.receive(b"more").ended == step.ended  # nothing more is read
    # The allowed origin (in any case), and a client that sends none (not a browser).
    for origin in ("https://DASH.example.com", None):
        server = MqttOverWs(policy)
        ws, hello = client(origin=origin)
        assert answer(ws, server.receive(hello).out) == [AcceptConnection(subprotocol="mqtt")]
    # A query string does not change the path.
    ws, hello = client(target="/mqtt?token=x")
    assert answer(ws, MqttOverWs(WsPolicy()).receive(hello).out) == [AcceptConnection(subprotocol="mqtt")]


def test_packets_across_frames_and_several_in_one_reach_the_reader_whole() -> None:
    server, ws = opened()
    frames = ws.send(BytesMessage(data=CONNECT[:5])) + ws.send(BytesMessage(data=CONNECT[5:9]))
    frames += ws.send(BytesMessage(data=CONNECT[9:] + PINGREQ + PINGREQ))
    step = server.receive(frames)
    assert step.ended is None and step.out == b""
    packets = PacketReader().feed(step.mqtt)
    assert [type(p).__name__ for p in packets] == ["Connect", "Pingreq", "Pingreq"]


@given(cuts=st.lists(st.integers(0, 400), max_size=12), seed=st.integers(0, 2**16))
def test_any_split_of_the_stream_gives_the_same_mqtt_bytes(cuts: list[int], seed: int) -> None:
    server = MqttOverWs(WsPolicy())
    ws, hello = client()
    answer(ws, MqttOverWs(WsPolicy()).receive(hello).out)  # the client opened, as with the server under test
    payload = CONNECT + PINGREQ * 3 + bytes(seed % 251 for _ in range(seed % 97))
    stream = hello + ws.send(BytesMessage(data=payload[:7])) + ws.send(BytesMessage(data=payload[7:]))
    points = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    got = b""
    for a, b in itertools.pairwise(points):
        step = server.receive(stream[a:b])
        assert step.ended is None
        got += step.mqtt
    assert got == payload


def test_a_large_frame_is_handed_on_in_pieces_never_reassembled() -> None:
    server, ws = opened()
    frame = ws.send(BytesMessage(data=os.urandom(1 << 20)))
    biggest = total = 0
    for i in range(0, len(frame), 4096):
        piece = server.receive(frame[i : i + 4096]).mqtt
        biggest, total = max(biggest, len(piece)), total + len(piece)
    assert total == 1 << 20 and biggest <= 4096


def test_a_text_frame_ends_the_connection_with_1003() -> None:
    server, ws = opened()
    step = server.receive(ws.send(TextMessage(data="CONNECT")))
    assert step.ended == "a text frame (MQTT-6.0.0-1)" and step.mqtt == b"" and not server.by_peer
    (close,) = answer(ws, step.out)
    assert isinstance(close, CloseConnection) and close.code == 1003
    assert server.send(PINGREQ) == b"" and not server.open


def test_pings_are_answered_and_pongs_counted() -> None:
    server, ws = opened()
    step = server.receive(ws.send(Ping(payload=b"are you there")))
    assert answer(ws, step.out) == [Pong(payload=b"are you there")]
    (ping,) = answer(ws, server.ping(b"1"))
    assert isinstance(ping, Ping)
    assert server.receive(ws.send(ping.response())).ended is None and server.pongs == 1


def test_a_close_is_answered_and_ends_the_connection() -> None:
    server, ws = opened()
    step = server.receive(ws.send(CloseConnection(code=1000, reason="bye")))
    assert step.ended == "closed by the peer (1000: bye)" and server.by_peer
    (reply,) = answer(ws, step.out)
    assert isinstance(reply, CloseConnection) and reply.code == 1000
    server2, _ = opened()
    assert server2.receive(b"").ended == "the peer closed its side"


def test_frames_that_break_rfc_6455_close_with_1002() -> None:
    server, ws = opened()
    step = server.receive(b"\x82\x05abcde")  # a client's frame must be masked
    assert step.ended is not None and step.ended.startswith("bad frame (1002") and step.mqtt == b""
    (close,) = answer(ws, step.out)
    assert isinstance(close, CloseConnection) and close.code == 1002


def test_a_request_that_is_no_websocket_handshake_gets_400() -> None:
    server = MqttOverWs(WsPolicy())
    step = server.receive(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n")
    assert step.ended is not None and step.ended.startswith("bad handshake")
    assert step.out.startswith(b"HTTP/1.1 400 ")


def test_an_endless_handshake_is_refused_431_not_buffered() -> None:
    server = MqttOverWs(WsPolicy())
    step = server.receive(b"GET /mqtt HTTP/1.1\r\nHost: x\r\n")
    assert step.ended is None and step.out == b""
    for _ in range(MAX_HEAD // 1000 + 2):
        step = server.receive(b"X-Pad: " + b"a" * 993 + b"\r\n")
        if step.ended:
            break
    assert step.ended is not None and "over 16384 bytes" in step.ended
    assert step.out.startswith(b"HTTP/1.1 431 ")
    assert server.receive(b"more").out == b""


def test_what_the_server_sends_is_one_binary_frame() -> None:
    server, ws = opened()
    data = encoders.encode_connack(False, 0) + b"\xd0\x00"
    assert answer(ws, server.send(data)) == [BytesMessage(data=data, frame_finished=True, message_finished=True)]
    assert answer(ws, server.close(1001, "going away"))[0] == CloseConnection(code=1001, reason="going away")
    assert server.close() == b""  # once
