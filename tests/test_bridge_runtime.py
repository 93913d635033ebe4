"""The bridge running (issue 64): this server in-process with a :class:`Bridge` to a real
Mosquitto on a free loopback port, messages counted on both sides: out and in at QoS 0
and 1 with prefixes, the notifications, a remote that stops answering (SIGSTOP) and
one restarted under a QoS 1 publisher, a refusal retried at the backoff, and two
brokers bridged both ways on ``#`` without a loop. Real processes and the real clock:
every wait is bounded."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import idlekeeper
from loadtest.processes import free_port, stop, wait_listening
from servers.heartbeat.bridge import BridgeAddress, parse_bridge
from servers.heartbeat.bridging import Bridge, announcer
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt.client import MQTT_311, ClientOptions, ClientSession, Message, Subscribed

from .mosquitto_peer import require_mosquitto
from .test_heartbeat import running
from .test_mqtt_client_session import Link

ROOT = Path(__file__).resolve().parent.parent

CONF = """\
{user}listener {port} 127.0.0.1
allow_anonymous {anonymous}
persistence false
"""


@dataclass
class Mosquitto:
    """A Mosquitto on a loopback port; :meth:`start` (re)starts it on the same port."""

    binary: str
    conf: Path
    port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> int:
        if self.procs:
            self.stop()
        quiet = subprocess.DEVNULL
        proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=quiet, stderr=quiet)
        self.procs.append(proc)
        wait_listening(self.port, proc)
        return self.port

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)  # a stopped process takes no SIGTERM
        stop(self.proc)


def mosquitto_at(tmp_path: Path, anonymous: bool = True) -> Iterator[Mosquitto]:
    binary = require_mosquitto()
    port = free_port()
    conf = tmp_path / f"mosquitto-{port}.conf"
    # Run as root, Mosquitto would drop to the "mosquitto" user; keep it as it is.
    user = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(CONF.format(user=user, port=port, anonymous="true" if anonymous else "false"))
    broker = Mosquitto(binary, conf, port)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[Mosquitto]:
    yield from mosquitto_at(tmp_path)


@pytest.fixture
def closed_remote(tmp_path: Path) -> Iterator[Mosquitto]:
    yield from mosquitto_at(tmp_path, anonymous=False)


@asynccontextmanager
async def bridged(url: str, *, own: bool = False, **settings: Any) -> AsyncIterator[tuple[int, Bridge]]:
    """This server, and a bridge of ``url`` from it: the server's port and the bridge.
    ``own``: its local notifications published as the server's, as a worker's are.
    ``settings``: the server's, which then knows the bridge as its own (the bridge's
    ``local_clientid`` must be given: the server names it without the test's hostname)."""
    spec = parse_bridge(url)
    config = HeartbeatConfig(port=0, connect_timeout=5, bridges=[spec], **settings) if settings else None
    running_server = running(config)
    async with (
        running_server as (server, _),
        idlekeeper.open_keeper(tick=0.05) as keeper,
        trio.open_nursery() as nursery,
    ):
        announce = announcer(server, spec.local_id("box")) if own else None
        bridge = Bridge(spec, int(server.port), keeper, hostname="box", announce=announce)
        await nursery.start(bridge.run)
        yield int(server.port), bridge
        nursery.cancel_scope.cancel()


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait (polling, bounded) until ``check()``."""
    with trio.fail_after(seconds):
        while True:
            if check():
                return
            await trio.sleep(0.02)


async def client(port: int, name: str, *filters: str, version: int = MQTT_311) -> Link:
    link = Link(ClientSession(ClientOptions(name, version)))
    await link.open(port)
    if filters:
        link.session.subscribe([(f, 1) for f in filters])
        await link.flush()
        await link.until(lambda e: isinstance(e, Subscribed))
    return link


async def collect(link: Link, seconds: float) -> None:
    """Read (and answer) whatever comes for ``seconds``."""
    with trio.move_on_after(seconds):
        await link.until(lambda e: False)


async def receive(link: Link, count: int, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while len({(t, p) for t, p, _ in link.messages()}) < count:  # distinct: QoS 1 may repeat
            await link.until(lambda e: isinstance(e, Message))


def url(port: int, *topics: str, **keys: object) -> str:
    query = "&".join([*(f"topic={t.replace(' ', '%20')}" for t in topics), *(f"{k}={v}" for k, v in keys.items())])
    return f"mqtt://127.0.0.1:{port}/edge?{query}"


@pytest.mark.parametrize("version", ["mqttv311", "mqttv50"])
async def test_messages_out_and_in_at_qos_0_and_1_with_prefixes(remote: Mosquitto, version: str) -> None:
    topics = ("sensors/# out 1 site/ cloud/site/", "cmd/# in 1 here/ there/")
    spec = url(remote.port, *topics, notifications="false", bridge_protocol_version=version)
    async with bridged(spec) as (port, bridge):
        cloud = await client(remote.port, "cloud", "cloud/#")
        here = await client(port, "here", "here/#")
        await until(lambda: bridge.remote.up)
        await trio.sleep(0.3)  # the remote SUBSCRIBE's SUBACK
        device = await client(port, "device")
        device.session.publish("site/sensors/t", b"q0", 0)
        device.session.publish("site/sensors/t", b"q1", 1)
        device.session.publish("site/other", b"not bridged", 1)
        await device.flush()
        await receive(cloud, 2)
        assert sorted(cloud.messages()) == [("cloud/site/sensors/t", b"q0", 0), ("cloud/site/sensors/t", b"q1", 1)]
        operator = await client(remote.port, "operator")
        operator.session.publish("there/cmd/reboot", b"c0", 0)
        operator.session.publish("there/cmd/reboot", b"c1", 1)
        await operator.flush()
        await receive(here, 2)
        assert sorted(here.messages()) == [("here/cmd/reboot", b"c0", 0), ("here/cmd/reboot", b"c1", 1)]
        await collect(cloud, 0.3)
        assert len(cloud.messages()) == 2  # "site/other" matched no topic
        # A retained message goes on retained: a later subscriber there finds it.
        device.session.publish("site/sensors/last", b"r", 1, retain=True)
        await device.flush()
        await receive(cloud, 3)
        late = await client(remote.port, "late", "cloud/site/sensors/last")
        await receive(late, 1)
        assert [e.retain for e in late.events if isinstance(e, Message)] == [True]


async def test_notifications_are_retained_1_when_connected_and_0_when_not(remote: Mosquitto) -> None:
    spec = url(remote.port, "a/# both 1", notification_topic="bridges/edge", restart_timeout="1")
    async with bridged(spec) as (port, bridge):
        await until(lambda: bridge.remote.up)
        await trio.sleep(0.3)
        here = await client(port, "here", "bridges/#")
        there = await client(remote.port, "there", "bridges/#")
        await receive(here, 1)
        await receive(there, 1)
        assert here.messages()[-1][:2] == ("bridges/edge", b"1")
        assert there.messages()[-1][:2] == ("bridges/edge", b"1")
        await trio.to_thread.run_sync(remote.stop)
        await here.until(lambda e: isinstance(e, Message) and e.payload == b"0")
        await trio.to_thread.run_sync(remote.start)
        fresh = await client(remote.port, "fresh", "bridges/#")
        await receive(fresh, 1)
        assert fresh.messages()[-1][:2] == ("bridges/edge", b"1")
        # Retained locally: a subscriber that comes later learns the state at once.
        late = await client(port, "late", "bridges/#")
        await receive(late, 1)
        assert late.messages()[-1][:2] == ("bridges/edge", b"1")


@pytest.mark.parametrize("version", ["mqttv311", "mqttv50"])
async def test_a_remote_that_stops_answering_is_noticed_within_one_and_a_half_keep_alives(
    remote: Mosquitto, version: str
) -> None:
    spec = url(remote.port, "a/# both 1", keepalive_interval="5", restart_timeout="1", bridge_protocol_version=version)
    async with bridged(spec) as (_, bridge):
        await until(lambda: bridge.remote.up)
        remote.proc.send_signal(signal.SIGSTOP)
        stopped = trio.current_time()
        await until(lambda: not bridge.remote.up, 1.5 * 5 + 1)
        # Not before a keep-alive interval has passed without a PINGRESP, either.
        assert trio.current_time() - stopped > 5 - 0.5
        remote.proc.send_signal(signal.SIGCONT)
        connections = bridge.connections
        await until(lambda: bridge.connections > connections, 10)
        assert bridge.remote.up


async def test_the_remote_restarted_under_a_qos_1_publisher_loses_nothing(remote: Mosquitto) -> None:
    spec = url(remote.port, "data/# out 1", restart_timeout="1", notifications="false")
    total = 150
    async with bridged(spec) as (port, bridge):
        first = await client(remote.port, "cloud", "data/#")
        await until(lambda: bridge.remote.up)
        await trio.sleep(0.3)
        device = await client(port, "device")
        tokens: set[int] = set()

        async def publish() -> None:
            for n in range(total):
                tokens.add(device.session.publish("data/n", b"%d" % n, 1))
                await device.flush()
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, first)
            nursery.start_soon(drain, device)  # its PUBACKs open its window
            nursery.start_soon(publish)
            await until(lambda: len(first.messages()) >= 30)
            # Killed outright, mid-stream: what it had not acknowledged the bridge still
            # holds, and the local broker holds what the bridge had not acknowledged.
            remote.proc.kill()
            await trio.to_thread.run_sync(remote.start)
            second = await client(remote.port, "cloud-again", "data/#")
            nursery.start_soon(drain, second)

            def got() -> set[bytes]:
                return {p for link in (first, second) for _, p, _ in link.messages()}

            await until(lambda: len(got()) >= total, 30)
            nursery.cancel_scope.cancel()
        assert got() == {b"%d" % n for n in range(total)}
        assert bridge.connections == 2
        assert tokens <= device.acknowledged()


async def drain(link: Link) -> None:
    """Read and answer ``link`` until its connection ends."""
    assert link.stream is not None
    try:
        while data := await link.stream.receive_some():
            link.events.extend(link.session.receive_data(data))
            await link.flush()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


async def test_a_refusal_is_logged_once_per_attempt_and_retried_at_the_backoff(
    closed_remote: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "servers.heartbeat.bridge")
    spec = url(closed_remote.port, "a/# out", restart_timeout="1", remote_username="nobody", remote_password="wrong")
    async with bridged(spec) as (_, bridge):
        await trio.sleep(3.5)
        attempts = bridge.attempts
    refusals = [r.getMessage() for r in caplog.records if "refused the connection" in r.getMessage()]
    assert 3 <= attempts <= 5  # one at once, then one a second: no tight loop
    assert len(refusals) == attempts
    assert "not-authorized" in refusals[0] or "bad-username-or-password" in refusals[0]
    assert bridge.connections == 0


@pytest.mark.parametrize("version", ["mqttv311", "mqttv50"])
async def test_two_brokers_bridged_both_ways_on_everything_do_not_loop(remote: Mosquitto, version: str) -> None:
    spec = url(remote.port, "# both 1", bridge_protocol_version=version, notifications="false")
    async with bridged(spec) as (port, bridge):
        here = await client(port, "here", "#")
        there = await client(remote.port, "there", "#")
        await until(lambda: bridge.remote.up)
        await trio.sleep(0.3)
        for link, topic in ((here, "from/here"), (there, "from/there")):
            link.session.publish(topic, b"x", 1)
            await link.flush()
        await collect(here, 1.0)
        await collect(there, 0.3)
        assert sorted(m[0] for m in here.messages()) == ["from/here", "from/there"]
        assert sorted(m[0] for m in there.messages()) == ["from/here", "from/there"]
        assert (bridge.forwarded_out, bridge.forwarded_in) == (1, 1)


CONNECTION = """\
listener {port} 127.0.0.1
allow_anonymous true
connection edge
address 127.0.0.1:{remote}
topic up/# out 1
topic down/# in 1
notification_topic bridges/edge
"""


@pytest.mark.parametrize(("workers", "form"), [(1, "option"), (2, "option"), (1, "file")])
async def test_the_bridge_option_runs_one_bridge_per_box(
    remote: Mosquitto, workers: int, form: str, tmp_path: Path
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "servers.heartbeat", "--workers", str(workers)]
    if form == "file":  # Mosquitto's connection section, as --bridge
        conf = tmp_path / "bridged.conf"
        conf.write_text(CONNECTION.format(port=port, remote=remote.port))
        argv += ["-c", str(conf)]
    else:
        spec = url(remote.port, "up/# out 1", "down/# in 1", notification_topic="bridges/edge")
        argv += ["--host", "127.0.0.1", "--port", str(port), "--bridge", spec]
    quiet = subprocess.DEVNULL
    proc = await trio.to_thread.run_sync(partial(subprocess.Popen, argv, cwd=ROOT, stdout=quiet, stderr=quiet))
    try:
        await trio.to_thread.run_sync(wait_listening, port, proc)
        there = await client(remote.port, "there", "up/#", "bridges/#")
        # The bridge's "1" says it is connected and subscribed on both sides.
        with trio.fail_after(10):
            while ("bridges/edge", b"1") not in [m[:2] for m in there.messages()]:
                await there.until(lambda e: isinstance(e, Message))
        here = [await client(port, f"here-{n}", "down/#") for n in range(2 * workers)]
        for n, link in enumerate(here):
            link.session.publish("up/n", b"%d" % n, 1)
            await link.flush()
        await receive(there, 1 + len(here))
        operator = await client(remote.port, "operator")
        operator.session.publish("down/cmd", b"go", 1)
        await operator.flush()
        for link in here:
            await receive(link, 1)
        await collect(there, 0.5)
        # Once each: one bridge for the box, whatever the workers.
        assert sorted(p for t, p, _ in there.messages() if t == "up/n") == [b"%d" % n for n in range(len(here))]
        assert [len(link.messages()) for link in here] == [1] * len(here)
    finally:
        stop(proc)


async def test_the_default_notification_topic_is_mosquittos(remote: Mosquitto) -> None:
    async with bridged(url(remote.port, "a/# out 1"), own=True) as (port, bridge):
        await until(lambda: bridge.remote.up)
        assert bridge.state_topic == "$SYS/broker/connection/box.edge/state"
        here = await client(port, "here", "$SYS/broker/connection/#")
        await receive(here, 1)
        assert here.messages()[-1][:2] == ("$SYS/broker/connection/box.edge/state", b"1")


def test_a_bridge_without_a_plain_listener_to_join_through_is_refused() -> None:
    argv = [sys.executable, "-m", "servers.heartbeat", "--listener", "ws://127.0.0.1:0"]
    done = subprocess.run(
        [*argv, "--bridge", "mqtt://127.0.0.1:1/x?topic=a"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 2
    assert "--bridge: a bridge joins this server through a plain mqtt:// listener" in done.stderr


@pytest.mark.parametrize(("total", "settings"), [(60, {}), (200, {"max_queued": 10})], ids=["window", "max-queued"])
async def test_what_goes_out_while_the_remote_is_away_waits_in_this_server(
    remote: Mosquitto, total: int, settings: dict[str, Any]
) -> None:
    # 60: three times the bridge's window, most of them wait in the broker. 200 past
    # --max-queued 10: a bridge's session is bounded by bytes, so all of them wait (a
    # device's keeps 10: tests/test_mqtt_outbox.py).
    spec = url(remote.port, "data/# out 1", restart_timeout="2", notifications="false", local_clientid="edge-bridge")
    async with bridged(spec, **settings) as (port, bridge):
        await until(lambda: bridge.remote.up)
        await trio.to_thread.run_sync(remote.stop)
        await until(lambda: not bridge.remote.up)
        device = await client(port, "device")
        for n in range(total):
            device.session.publish("data/n", b"%d" % n, 1)
        await device.flush()
        await trio.to_thread.run_sync(remote.start)
        cloud = await client(remote.port, "cloud", "data/#")  # before the bridge is back
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, device)
            await receive(cloud, total, 30)
            nursery.cancel_scope.cancel()
        # QoS 1: at least once (a copy sent as the remote went may come again).
        assert {p for _, p, _ in cloud.messages()} == {b"%d" % n for n in range(total)}


async def test_each_connection_to_the_remote_brings_it_the_local_retained_messages(remote: Mosquitto) -> None:
    # As Mosquitto's bridge: the out topics' retained messages go to the remote on every
    # connection to it, so a remote that lost its store (restarted without persistence)
    # or missed a QoS 0 retained update while away holds the edge's again.
    spec = url(remote.port, "state/# out 1", restart_timeout="1", notifications="false")
    async with bridged(spec) as (port, bridge):
        await until(lambda: bridge.remote.up)
        device = await client(port, "device")
        device.session.publish("state/kept", b"before", 1, retain=True)
        await device.flush()
        await until(lambda: bridge.forwarded_out >= 1)
        remote.proc.kill()  # its retained store goes with it
        await until(lambda: not bridge.remote.up)
        device.session.publish("state/zero", b"while-away", 0, retain=True)
        await device.flush()
        await trio.sleep(0.3)
        await trio.to_thread.run_sync(remote.start)
        await until(lambda: bridge.remote.up and bridge.connections == 2, 15)
        late = await client(remote.port, "late", "state/#")
        await receive(late, 2, 10)
        got = {(e.topic, e.payload, e.retain) for e in late.events if isinstance(e, Message)}
        assert got == {("state/kept", b"before", True), ("state/zero", b"while-away", True)}


# -- under MockClock: the reconnection's schedule ------------------------------------------


async def test_the_backoff_and_the_addresses_tried_in_turn(
    clock: trio.testing.MockClock, keeper: idlekeeper.Keeper
) -> None:
    spec = parse_bridge("mqtt://127.0.0.1:1,127.0.0.1:2/edge?topic=a&restart_timeout=2%2020")
    # The jitter's draw is its upper end: each wait is min(cap, 3 x the last one).
    bridge = Bridge(spec, 1, keeper, hostname="box", uniform=lambda low, high: high)
    outcomes = iter([False, False, False, False, True])
    tried: list[tuple[float, int]] = []

    async def attempt(address: BridgeAddress) -> bool:
        tried.append((trio.current_time(), address.port))
        return next(outcomes, False)

    bridge._attempt = attempt  # type: ignore[method-assign]
    start = trio.current_time()
    with trio.move_on_after(100):
        await bridge._remote_loop()
    # Failures go to the next address and back off (6, 18, then the cap 20); a connection
    # that held sends the next attempt to the first address after the base wait.
    assert [(round(t - start), port) for t, port in tried] == [
        (0, 1), (6, 2), (24, 1), (44, 2), (64, 1), (66, 1), (72, 2), (90, 1)
    ]  # fmt: skip


TLS_CONF = """\
{user}listener {port} 127.0.0.1
listener {tls_port} 127.0.0.1
certfile {dir}/server.pem
keyfile {dir}/server.key
allow_anonymous true
persistence false
"""


async def test_over_tls_with_the_bridges_ca(tmp_path: Path) -> None:
    import trustme

    binary = require_mosquitto()
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("127.0.0.1")
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(tmp_path / "server.pem"), append=True)
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    port, tls_port = free_port(), free_port()
    conf = tmp_path / "tls.conf"
    user = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(TLS_CONF.format(user=user, port=port, tls_port=tls_port, dir=tmp_path))
    broker = Mosquitto(binary, conf, port)
    await trio.to_thread.run_sync(broker.start)
    try:
        await trio.to_thread.run_sync(wait_listening, tls_port, broker.proc)
        where = f"mqtts://127.0.0.1:{tls_port}/edge?topic=up/%23%20out%201&bridge_cafile={tmp_path}/ca.pem"
        async with bridged(where + "&notifications=false") as (local, bridge):
            cloud = await client(port, "cloud", "up/#")
            await until(lambda: bridge.remote.up)
            await trio.sleep(0.3)
            device = await client(local, "device")
            device.session.publish("up/t", b"sealed", 1)
            await device.flush()
            await receive(cloud, 1)
            assert cloud.messages() == [("up/t", b"sealed", 1)]
    finally:
        await trio.to_thread.run_sync(broker.stop)
