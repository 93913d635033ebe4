"""A real Mosquitto bridging to this server (issue 64), with Mosquitto's defaults: a 3.1.1
bridge whose CONNECT is marked a bridge's (``try_private true``: protocol level 0x84),
its state published and left as a Will on ``$SYS/broker/connection/<id>/state``.

This server takes the mark as Mosquitto does: the bridge's subscriptions get No Local
and Retain As Published, so a topic bridged both ways passes each message once and a
retained message stays retained; it may write its state there (and nowhere else under
``$SYS``). Real processes; every wait bounded."""

from __future__ import annotations

import collections
from functools import partial

import pytest
import trio

from loadtest.mqtt_targets import MqttTarget, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.mqtt.client import Acknowledged, Message

from .mosquitto_peer import require_mosquitto
from .test_bridge_runtime import ROOT, client, drain, until
from .test_heartbeat import running
from .test_mqtt_client_session import Link

EDGE = """\
connection up
address 127.0.0.1:{remote}
remote_clientid edge-up
restart_timeout 1
topic data/# out 1
topic cmd/# in 1
topic both/# both 1
"""
STATE = "$SYS/broker/connection/edge-up/state"


@pytest.fixture
def mosquitto() -> str:
    return require_mosquitto()


def start_edge(remote: int) -> MqttTarget:
    """Mosquitto with the bridge's section, on a port of its own."""
    return start_mosquitto("edge", free_port(), EDGE.format(remote=remote))


async def publish(port: int, topic: str, payload: bytes, retain: bool = False) -> None:
    """Publish at QoS 1 from a client of its own, until acknowledged."""
    link = await client(port, f"pub-{free_port()}")
    link.session.publish(topic, payload, 1, retain)
    await link.flush()
    with trio.fail_after(10):
        await link.until(lambda e: isinstance(e, Acknowledged))
    await link.cut()


def seen(link: Link) -> collections.Counter[tuple[str, bytes, bool]]:
    return collections.Counter((e.topic, e.payload, e.retain) for e in link.events if isinstance(e, Message))


@pytest.mark.parametrize("workers", [1, 2])
async def test_mosquittos_bridge_to_this_server_with_its_defaults(mosquitto: str, workers: int) -> None:
    if workers == 1:
        async with running() as (server, _):
            await bridged_from_mosquitto(int(server.port))
        return
    port = free_port()
    ours = await trio.to_thread.run_sync(partial(start_heartbeat, port, workers, cwd=str(ROOT)))
    try:
        await bridged_from_mosquitto(port)
    finally:
        stop(ours)


async def bridged_from_mosquitto(port: int) -> None:
    here = await client(port, "here", "data/#", "both/#", "$SYS/broker/connection/#")
    edge = await trio.to_thread.run_sync(start_edge, port)
    edge_port = edge.port
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, here)
            # Its state, written here under $SYS: the bridge was let in, Will and all.
            await until(lambda: (STATE, b"1", False) in seen(here) or (STATE, b"1", True) in seen(here), 15)
            there = await client(edge_port, "there", "cmd/#", "both/#")
            nursery.start_soon(drain, there)
            await trio.sleep(0.5)  # the bridge's subscriptions here are in place
            for at, topic in ((edge_port, "data/up"), (port, "cmd/down"), (port, "both/here")):
                await publish(at, topic, topic.encode())
            await publish(edge_port, "both/there", b"both/there")
            await publish(edge_port, "both/kept", b"kept", retain=True)
            await until(lambda: ("both/kept", b"kept", False) in seen(here), 10)
            await until(lambda: ("cmd/down", b"cmd/down", False) in seen(there), 10)
            await trio.sleep(1.0)  # an echo would have come back by now
            mine = {k: v for k, v in seen(here).items() if not k[0].startswith("$")}
            theirs = seen(there)
            expected_here = {("data/up", b"data/up", False), ("both/here", b"both/here", False)}
            expected_here |= {("both/there", b"both/there", False), ("both/kept", b"kept", False)}
            assert mine == dict.fromkeys(expected_here, 1)  # each once: no loop
            expected_there = {("cmd/down", b"cmd/down", False), ("both/here", b"both/here", False)}
            expected_there |= {("both/there", b"both/there", False), ("both/kept", b"kept", False)}
            assert theirs == dict.fromkeys(expected_there, 1)
            # Retain As Published: the bridge's copy kept the flag, so this server retains it.
            late = await client(port, "late", "both/kept")
            with trio.fail_after(10):
                await late.until(lambda e: isinstance(e, Message))
            assert ("both/kept", b"kept", True) in seen(late)
            # Killed: its Will says 0 here.
            edge.proc.kill()
            edge.proc.wait()
            await until(lambda: any(t == STATE and p == b"0" for t, p, _ in seen(here)), 10)
            nursery.cancel_scope.cancel()
    finally:
        edge.stop()
