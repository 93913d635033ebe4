"""One bridge per fleet (issue 64): three gateways on a real Redis, each given the same
``--bridge`` to a real Mosquitto. One gateway runs it at a time (its duty, a lease in
Redis), so the remote gets each message once whichever gateway it was published on.
The runner SIGKILLed, another takes the bridge over (the same client ids, the local
session carried over in Redis) and what is published meanwhile at QoS 1 arrives; that
one stalled (SIGSTOP) past the lease, the third takes over, and the stalled one, resumed,
stops its own; Redis restarted, the bridge carries on.
Real processes and clock; every wait bounded."""

from __future__ import annotations

import collections
import signal
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
    started = [await trio.to_thread.run_sync(start_gateway, redis, bridge, tmp_path, f"gw{i}") for i in range(3)]
    try:
        cloud = await client(remote.port, "cloud", "data/#", "$SYS/broker/connection/#")

        def notes() -> list[bytes]:
            return [p for t, p, _ in cloud.messages() if t == "$SYS/broker/connection/fleet.edge/state"]

        def payloads() -> collections.Counter[bytes]:
            return collections.Counter(p for t, p, _ in cloud.messages() if t.startswith("data/"))

        def runner() -> int:
            name = holder(redis)
            return int(name.removeprefix("gw")) if name else -1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, cloud)
            await until(lambda: notes()[-1:] == [b"1"], 30)
            devices = [await client(port, f"device{i}") for i, (_, port, _) in enumerate(started)]
            for d in devices:
                nursery.start_soon(drain, d)

            async def publish(at: int, label: bytes, count: int) -> set[bytes]:
                for n in range(count):
                    devices[at].session.publish("data/n", b"%s-%d" % (label, n), 1)
                await devices[at].flush()
                return {b"%s-%d" % (label, n) for n in range(count)}

            want = set()
            for i in range(3):
                want |= await publish(i, b"first%d" % i, 20)
            await until(lambda: set(payloads()) >= want, 20)
            await trio.sleep(1.0)  # a second bridge's copies would have come by now
            assert set(payloads().values()) == {1}, payloads()
            # One bridge: connected once. Two (the same ids) would take each other's
            # sessions over, here and on the remote, and its state would flap.
            assert notes() == [b"1"], notes()
            # The runner SIGKILLed: another gateway takes the bridge over once the lease
            # lapses, and what is published meanwhile waits in the bridge's session.
            first = runner()
            started[first][0].kill()
            started[first][0].wait()
            alive = [i for i in range(3) if i != first]
            want |= await publish(alive[0], b"after", 20)
            await until(lambda: set(payloads()) >= want, 30)
            second = runner()
            assert second in alive
            assert notes()[-2:] == [b"0", b"1"]  # the dead runner's Will, then the new one
            # The new runner stalled (SIGSTOP) past the lease: the last gateway takes over.
            last = next(i for i in alive if i != second)
            started[second][0].send_signal(signal.SIGSTOP)
            await until(lambda: runner() == last, 20)
            want |= await publish(last, b"stalled", 10)
            await until(lambda: set(payloads()) >= want, 30)
            # Resumed, it finds the duty taken and stops its bridge: the remote keeps one.
            started[second][0].send_signal(signal.SIGCONT)
            await trio.sleep(3.0)
            assert runner() == last
            resumed = await publish(last, b"resumed", 10)
            want |= resumed
            await until(lambda: set(payloads()) >= want, 30)
            await trio.sleep(1.0)
            assert {p: n for p, n in payloads().items() if p in resumed} == dict.fromkeys(resumed, 1)
            # Redis restarted, empty: the bridge stops if its lease could not be renewed
            # meanwhile (no second runner can be ruled out then), and runs on once Redis
            # answers; what is published after that is bridged.
            await trio.to_thread.run_sync(redis.restart)
            await trio.sleep(5.0)  # the fleet's resynchronisation, and the bridge's return
            assert notes()[-1:] == [b"1"], notes()
            want |= await publish(last, b"again", 10)
            await until(lambda: set(payloads()) >= want, 30)
            nursery.cancel_scope.cancel()
    finally:
        for proc, _, _ in started:
            proc.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
