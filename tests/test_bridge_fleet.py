"""One bridge per fleet (issue 64): two gateways on a real Redis, each given the same
``--bridge`` to a real Mosquitto. One gateway runs it at a time (its duty, a lease in
Redis), so the remote gets each message once whichever gateway it was published on;
the runner SIGKILLed, the other takes the bridge over (the same client ids, the local
session carried over in Redis) and what is published meanwhile at QoS 1 arrives; Redis
restarted, the bridge stops and comes back.
Real processes and clock; every wait bounded."""

from __future__ import annotations

import collections
import socket
import subprocess
from pathlib import Path

import trio

from loadtest.processes import free_port, start_heartbeat

from .redis_server import RedisServer
from .test_bridge_runtime import ROOT, Mosquitto, client, drain, until, url
from .test_bridge_runtime import remote as remote  # the fixture, used by name
from .test_fleet_faults import redis as redis  # the fixture, used by name

DUTY = b"idlekeeper:duty:bridge:edge"


def holder(redis: RedisServer) -> str:
    """The node holding the bridge's duty, as Redis says (GET, in RESP by hand)."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=5) as s:
        s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(DUTY), DUTY))
        reply = s.recv(4096)
    if reply.startswith(b"$-1"):
        return ""
    token = reply.split(b"\r\n")[1].decode()
    return token.partition("/")[0]  # the node: gw0/w0/PID@time


def start_gateway(
    redis: RedisServer, bridge: str, tmp_path: Path, name: str
) -> tuple[subprocess.Popen[str], int, Path]:
    port = free_port()
    log = tmp_path / f"{name}.stderr"
    args = ["--cluster", redis.url, "--node", name, "--tick", "0.05", "--lease", "3", "--bridge", bridge]
    return start_heartbeat(port, 1, args, cwd=str(ROOT), log=log), port, log


async def test_a_fleet_runs_one_bridge_and_another_gateway_takes_it_over(
    redis: RedisServer, remote: Mosquitto, tmp_path: Path
) -> None:
    bridge = url(remote.port, "data/# out 1", restart_timeout="1", keepalive_interval="5")
    started = [await trio.to_thread.run_sync(start_gateway, redis, bridge, tmp_path, f"gw{i}") for i in range(2)]
    try:
        cloud = await client(remote.port, "cloud", "data/#", "$SYS/broker/connection/#")

        def notes() -> list[bytes]:
            return [p for t, p, _ in cloud.messages() if t == "$SYS/broker/connection/fleet.edge/state"]

        def payloads() -> collections.Counter[bytes]:
            return collections.Counter(p for t, p, _ in cloud.messages() if t.startswith("data/"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, cloud)
            await until(lambda: notes()[-1:] == [b"1"], 30)
            devices = [await client(port, f"device{i}") for i, (_, port, _) in enumerate(started)]
            for d in devices:
                nursery.start_soon(drain, d)
            for n in range(20):
                for i, d in enumerate(devices):
                    d.session.publish(f"data/{i}", b"%d-%d" % (i, n), 1)
            for d in devices:
                await d.flush()
            first = {b"%d-%d" % (i, n) for i in range(2) for n in range(20)}
            await until(lambda: set(payloads()) >= first, 20)
            await trio.sleep(1.0)  # a second bridge's copies would have come by now
            assert set(payloads().values()) == {1}, payloads()
            # One bridge: connected once. Two (the same ids) would take each other's
            # sessions over, here and on the remote, and its state would flap.
            assert notes() == [b"1"], notes()
            runner = int(holder(redis).removeprefix("gw"))
            survivor = 1 - runner
            # The runner dies: the other gateway takes the bridge over once the lease lapses,
            # and what its device publishes meanwhile waits in the bridge's session.
            started[runner][0].kill()
            started[runner][0].wait()
            for n in range(20):
                devices[survivor].session.publish("data/after", b"after-%d" % n, 1)
            await devices[survivor].flush()
            later = {b"after-%d" % n for n in range(20)}
            await until(lambda: set(payloads()) >= first | later, 30)
            assert holder(redis) == f"gw{survivor}"
            assert notes()[-2:] == [b"0", b"1"]  # the dead runner's Will, then the new one
            # Redis restarted, empty: the bridge stops if its lease could not be renewed
            # meanwhile (no second runner can be ruled out then), and runs on once Redis
            # answers; what is published after that is bridged.
            await trio.to_thread.run_sync(redis.restart)
            await trio.sleep(5.0)  # the fleet's resynchronisation, and the bridge's return
            assert notes()[-1:] == [b"1"], notes()
            for n in range(10):
                devices[survivor].session.publish("data/again", b"again-%d" % n, 1)
            await devices[survivor].flush()
            again = {b"again-%d" % n for n in range(10)}
            await until(lambda: set(payloads()) >= first | later | again, 30)
            nursery.cancel_scope.cancel()
    finally:
        for proc, _, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
