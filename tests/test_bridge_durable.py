"""What waits for a bridge's remote survives this server's crash (issue 64): with
``--persistence`` (sync ``always``, the default) the bridge's local session is on disk,
so QoS 1 messages acknowledged to their publisher while the remote was away, then the
server SIGKILLed and started again, all reach the remote once it is back, past the
queue's message bound (``--max-queued 10``: a bridge's is bounded by bytes). Real
processes; every wait bounded."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio

from loadtest.processes import free_port, start_heartbeat, stop

from .test_bridge_runtime import ROOT, Mosquitto, client, receive, url
from .test_bridge_runtime import remote as remote  # the fixture, used by name
from .test_mqtt_client_session import Link


async def acknowledged(link: Link, count: int) -> None:
    with trio.fail_after(20):
        while len(link.acknowledged()) < count:
            await link.until(lambda e: True)


async def test_messages_waiting_for_the_remote_survive_a_crash_with_persistence(
    remote: Mosquitto, tmp_path: Path
) -> None:
    spec = url(remote.port, "data/# out 1", restart_timeout="1", notifications="false", local_clientid="edge-bridge")
    port, db = free_port(), tmp_path / "edge.db"
    args = ["--persistence", str(db), "--max-queued", "10", "--bridge", spec]
    start = partial(start_heartbeat, port, 1, args, cwd=str(ROOT))
    edge = await trio.to_thread.run_sync(start)
    try:
        await trio.to_thread.run_sync(remote.stop)
        device = await client(port, "device")
        total = 100
        for n in range(total):
            device.session.publish("data/n", b"%d" % n, 1)
        await device.flush()
        await acknowledged(device, total)  # each PUBACK after its commit
        edge.kill()  # no shutdown: what is on disk is all there is
        edge.wait()
        await trio.to_thread.run_sync(remote.start)
        cloud = await client(remote.port, "cloud", "data/#")
        edge = await trio.to_thread.run_sync(start)
        await receive(cloud, total, 30)
        # QoS 1: at least once (a copy sent as the remote went may come again).
        assert {p for _, p, _ in cloud.messages()} == {b"%d" % n for n in range(total)}
    finally:
        if edge.poll() is None:
            stop(edge)
