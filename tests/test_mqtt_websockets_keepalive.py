"""MQTT over WebSockets in-process under MockClock, both engines: the keep-alive is
held as over TCP (a silent device closed at 1.5 x keep-alive, at most a tick late;
a pinging one kept), the presence events are the same, and on the dense engine a
WebSocket device costs no task."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
from trio.testing import MockClock
from wsproto.events import BytesMessage

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.presence.event import PresenceEvent
from servers.heartbeat.server.lifecycle import HeartbeatServer
from servers.heartbeat.worker import serve_heartbeat

from .ws_client import WsClient

TICK = 0.05
ENGINES = pytest.mark.parametrize("engine", ["dense", "streams"])


@asynccontextmanager
async def running(engine: str) -> AsyncIterator[tuple[HeartbeatServer, list[PresenceEvent]]]:
    events: list[PresenceEvent] = []
    cfg = HeartbeatConfig(port=0, tick=TICK, connect_timeout=5, engine=engine)
    cfg.extra_sinks.append(events.append)
    ws = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, cfg, ws_listeners=ws))
        yield server, events
        nursery.cancel_scope.cancel()


async def device(port: int, client_id: str, keep_alive: int) -> WsClient:
    """An MQTT device over a WebSocket, connected (its CONNACK read)."""
    client = await WsClient.open(port, "/mqtt", subprotocols=["mqtt"])
    assert client.accepted is not None and client.accepted.subprotocol == "mqtt"
    await client.send(encoders.encode_connect(client_id, keep_alive=keep_alive))
    assert (await client.receive())[:1] == b"\x20"  # CONNACK
    return client


async def mqtt_bytes(client: WsClient, size: int) -> bytes:
    """``size`` MQTT bytes, however the server framed them."""
    got = b""
    while len(got) < size:
        message = await client.receive()
        assert isinstance(message, bytes)
        got += message
    return got


@ENGINES
async def test_a_silent_websocket_device_is_closed_at_one_and_a_half_keepalive(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, events):
        silent = await device(server.ws_port, "ws-silent", keep_alive=4)
        alive = await device(server.ws_port, "ws-alive", keep_alive=4)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def ping() -> None:
                while True:
                    await alive.send(encoders.encode_pingreq())
                    assert await alive.receive() == encoders.encode_pingresp()
                    await trio.sleep(3)

            nursery.start_soon(ping)
            closed = await silent.until_closed()
            took = trio.current_time() - start
            await trio.sleep(20)
            nursery.cancel_scope.cancel()
        assert closed.code in (1000, 1006)
        assert 6.0 <= took <= 6.0 + TICK + 0.01, took  # never early, at most one tick late
        offline = [e for e in events if e.status == "offline"]
        assert [(e.client_id, e.reason) for e in offline] == [("ws-silent", "keepalive-timeout")]
        online = {e.client_id for e in events if e.status == "online"}
        assert online == {"ws-silent", "ws-alive"}


@ENGINES
async def test_websocket_and_tcp_devices_share_one_presence(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, events):
        watcher = await WsClient.open(server.ws_port, "/mqtt", subprotocols=["mqttv3.1", "mqtt"])
        await watcher.send(encoders.encode_connect("ws-watcher", keep_alive=60))
        assert (await watcher.receive())[:1] == b"\x20"
        await watcher.send(encoders.encode_subscribe(1, [("$SYS/presence/#", 0)]))
        await watcher.receive()  # SUBACK
        await watcher.receive()  # its own presence, retained
        tcp = await trio.open_tcp_stream("127.0.0.1", server.port)
        await tcp.send_all(encoders.encode_connect("tcp-dev", keep_alive=60))
        await tcp.receive_some(4)
        packet = await watcher.receive()
        assert isinstance(packet, bytes) and b"$SYS/presence/tcp-dev" in packet
        body = json.loads(packet[packet.index(b"{") :])
        assert body["status"] == "online"
        assert [e.client_id for e in events if e.status == "online"] == ["ws-watcher", "tcp-dev"]
        # Two MQTT packets in one frame, then one packet across two frames.
        both = encoders.encode_pingreq() + encoders.encode_pingreq()
        await watcher.stream.send_all(watcher.ws.send(BytesMessage(data=both)))
        assert await mqtt_bytes(watcher, 4) == encoders.encode_pingresp() * 2  # in one frame or two
        half = encoders.encode_pingreq()
        await watcher.stream.send_all(watcher.ws.send(BytesMessage(data=half[:1], message_finished=False)))
        await watcher.stream.send_all(watcher.ws.send(BytesMessage(data=half[1:], message_finished=True)))
        assert await watcher.receive() == encoders.encode_pingresp()


async def test_a_websocket_device_on_the_dense_engine_costs_no_task(clock: MockClock) -> None:
    async with running("dense") as (server, _):
        before = len(server.nursery.child_tasks)
        devices = [await device(server.ws_port, f"ws-{i}", keep_alive=60) for i in range(20)]
        assert len(server.nursery.child_tasks) == before
        assert len(devices) == 20
    async with running("streams") as (server, _):
        before = len(server.nursery.child_tasks)
        devices = [await device(server.ws_port, f"ws-{i}", keep_alive=60) for i in range(20)]
        assert len(server.nursery.child_tasks) >= before + 20  # the other engine: a task each
