"""MQTT over WebSockets on the heartbeat server (issue 29, ``--ws-port``): paho-mqtt
with ``transport="websockets"`` (3.1.1 and 5.0) beside TCP clients on the same server,
on both engines; the keep-alive held as over TCP (a silent 5.0 client told 0x8D in a
frame); a text frame closes the connection (MQTT-6.0.0-1); a browser page from an
origin not allowed is refused 403."""

from __future__ import annotations

import base64
import os
import socket
import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request, TextMessage

from loadtest.processes import free_port
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets

from .test_heartbeat_clients import Server, stalled_while_pinging
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_mqtt5_server import Paho5, by_topic, presence
from .test_mqtt5_server import clients as clients  # the fixture, used by name

ENGINES = ["dense", "streams"]


class RawWs:
    """A WebSocket client on a raw socket (wsproto's client side), carrying MQTT bytes."""

    def __init__(self, port: int, origin: str | None = None, subprotocols: tuple[str, ...] = ("mqtt",)) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(5)
        self.ws = WSConnection(ConnectionType.CLIENT)
        headers = [] if origin is None else [(b"Origin", origin.encode())]
        self.sock.sendall(
            self.ws.send(
                Request(host="127.0.0.1", target="/mqtt", subprotocols=list(subprotocols), extra_headers=headers)
            )
        )
        self.pending: list[object] = []

    def events(self, until: type, seconds: float = 5.0) -> list[object]:
        """Events until one of type ``until`` (or EOF); all of them, in order."""
        deadline = time.monotonic() + seconds
        out: list[object] = []
        while time.monotonic() < deadline:
            while self.pending:
                event = self.pending.pop(0)
                out.append(event)
                if isinstance(event, until):
                    return out
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            self.ws.receive_data(data or None)
            self.pending += list(self.ws.events())
            if not data and not self.pending:
                return out
        return out

    def send(self, mqtt_bytes: bytes) -> None:
        self.sock.sendall(self.ws.send(BytesMessage(data=mqtt_bytes)))


def connected(ws_port: int, client_id: str, keep_alive: int = 30) -> RawWs:
    """A 3.1.1 device over a WebSocket, past its CONNACK."""
    client = RawWs(ws_port)
    client.events(AcceptConnection)
    client.send(encoders.encode_connect(client_id, keep_alive=keep_alive))
    client.events(BytesMessage)  # its CONNACK
    return client


def ws_server(start: Any, *args: str) -> tuple[Server, int]:
    ws_port = free_port()
    return start("--ws-port", str(ws_port), *args), ws_port


@pytest.mark.parametrize("engine", ENGINES)
def test_paho_over_websockets_beside_tcp_clients(start_server: Any, clients: list[Paho5], engine: str) -> None:
    server, ws_port = ws_server(start_server, "--engine", engine)
    watcher = Paho5(server.port, "tcp-watcher")  # over TCP
    clients.append(watcher.start())
    watcher.subscribe(("ws/#", 1), (PRESENCE + "#", 0))
    for protocol, name in ((mqtt.MQTTv311, "browser-311"), (mqtt.MQTTv5, "browser-5")):
        device = Paho5(ws_port, name, protocol=protocol, transport="websockets")
        clients.append(device.start())
        device.subscribe(("cmd/" + name, 1))
        device.client.publish("ws/" + name, b"hello from a browser", qos=1).wait_for_publish(5)
        time.sleep(0.2)
        watcher.client.publish("cmd/" + name, b"to the browser", qos=1).wait_for_publish(5)
        topic = "cmd/" + name
        device.wait(lambda ms: bool(by_topic(ms, topic)))  # noqa: B023 (waited for here, in this turn)
    watcher.wait(lambda ms: len(by_topic(ms, "ws/browser-311")) == 1 and len(by_topic(ms, "ws/browser-5")) == 1)
    online = presence(watcher.messages, "browser-311") + presence(watcher.messages, "browser-5")
    assert [(e["status"], e["protocol_level"]) for e in online] == [("online", 4), ("online", 5)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_silent_5_0_client_over_websockets_is_told_0x8d_in_a_frame(start_server: Any, engine: str) -> None:
    server, ws_port = ws_server(start_server, "--engine", engine)
    client = RawWs(ws_port)
    assert client.events(AcceptConnection)[-1] == AcceptConnection(subprotocol="mqtt")
    client.send(v5_codec.pack(v5_packets.Connect("ws-silent", 1)))
    started = time.monotonic()
    got = client.events(CloseConnection, seconds=6)
    frames = b"".join(bytes(e.data) for e in got if isinstance(e, BytesMessage))
    packets = v5_codec.read_packets(frames)
    assert isinstance(packets[0], v5_packets.Connack) and packets[-1] == v5_packets.Disconnect(0x8D)
    assert 1.4 <= time.monotonic() - started <= 3.0
    (ended,) = server.wait_for(lambda e: e.get("client_id") == "ws-silent" and e["status"] == "offline")
    assert ended["reason"] == "keepalive-timeout" and ended["reason_code"] == 0x8D


def test_a_text_frame_closes_the_connection_with_1003(start_server: Any) -> None:
    server, ws_port = ws_server(start_server)
    client = connected(ws_port, "ws-texter")
    client.sock.sendall(client.ws.send(TextMessage(data="\xc0\x00")))  # a PINGREQ, as text: not MQTT
    closes = [e for e in client.events(CloseConnection) if isinstance(e, CloseConnection)]
    assert closes and closes[0].code == 1003
    (ended,) = server.wait_for(lambda e: e.get("client_id") == "ws-texter" and e["status"] == "offline")
    assert ended["reason"] == "protocol-error"
    healthy = RawWs(ws_port)  # the listener serves on
    assert healthy.events(AcceptConnection)[-1] == AcceptConnection(subprotocol="mqtt")


def test_a_page_from_an_origin_not_allowed_is_refused(start_server: Any) -> None:
    _, ws_port = ws_server(start_server, "--ws-allowed-origins", "https://dash.example.com")
    key = base64.b64encode(os.urandom(16)).decode()
    for origin, status in (("https://evil.example.net", b"403"), ("https://dash.example.com", b"101")):
        with socket.create_connection(("127.0.0.1", ws_port)) as sock:
            sock.settimeout(5)
            sock.sendall(
                (
                    f"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n"
                    f"Origin: {origin}\r\n\r\n"
                ).encode()
            )
            assert sock.recv(4096).split(b" ")[1] == status


def test_a_disconnect_and_a_close_in_one_read_end_the_session_cleanly(start_server: Any) -> None:
    """The MQTT bytes of a read are handed on before the close behind them ends the stream."""
    server, ws_port = ws_server(start_server)
    client = connected(ws_port, "ws-leaver")
    client.sock.sendall(client.ws.send(BytesMessage(data=b"\xe0\x00")) + client.ws.send(CloseConnection(code=1000)))
    assert next(e for e in client.events(CloseConnection) if isinstance(e, CloseConnection)).code == 1000
    (ended,) = server.wait_for(lambda e: e.get("client_id") == "ws-leaver" and e["status"] == "offline")
    assert ended["reason"] == "disconnect"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sigstop_spares_a_websocket_device_whose_pings_wait_in_the_kernel(start_server: Any, engine: str) -> None:
    """The stall check looks at the socket under the frames: a device over a WebSocket
    that kept pinging while the server was stopped survives; a silent one is cut."""
    server, ws_port = ws_server(start_server, "--engine", engine)
    alive = connected(ws_port, "ws-stall-alive", keep_alive=1)  # deadline 1.5 s
    quiet = connected(ws_port, "ws-stall-quiet", keep_alive=1)  # held open, silent
    with stalled_while_pinging(server.proc, lambda: alive.send(encoders.encode_pingreq())):
        server.wait_for(lambda e: e.get("client_id") == "ws-stall-quiet" and e["status"] == "offline")
        time.sleep(2.0)
    offline = {e["client_id"]: e["reason"] for e in server.events() if e["status"] == "offline"}
    quiet.sock.close()
    assert offline.get("ws-stall-quiet") == "keepalive-timeout"
    assert "ws-stall-alive" not in offline
