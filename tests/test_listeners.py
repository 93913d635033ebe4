"""Several listeners in one server: each its own address, port, protocol, TLS, limits
and (a listener's own password file and ACL) authentication, all one broker with one
presence registry; the ``--listener`` form; presence events that name the listener."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from trio.testing import MockClock

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.listener import ListenerConfig, ListenerSpec, parse_listener
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.security.acl import AclFile
from servers.heartbeat.security.passwords import PasswordFile
from servers.settings import SettingError

from .test_heartbeat import Client, publish_topic, running
from .test_tls_servers import Certs, certs, stop

__all__ = ["certs"]  # the fixture, shared with the TLS tests

ROOT = Path(__file__).resolve().parent.parent


# -- the --listener form -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "protocol", "address", "port"),
    [
        ("mqtt://127.0.0.1:1883", "mqtt://127.0.0.1:1883", "mqtt", "127.0.0.1", 1883),
        ("1884", "mqtt://:1884", "mqtt", "", 1884),
        ("ws://:9001", "ws://:9001", "websockets", "", 9001),
        ("mqtt://[::1]:1883", "mqtt://[::1]:1883", "mqtt", "::1", 1883),
        ("WS://localhost:0", "ws://localhost:0", "websockets", "localhost", 0),
    ],
)
def test_a_listener_is_read_from_its_url(text: str, name: str, protocol: str, address: str, port: int) -> None:
    spec = parse_listener(text)
    assert (spec.name, spec.protocol, spec.address, spec.port) == (name, protocol, address, port)
    assert parse_listener(spec.text()) == spec


def test_a_listener_keeps_its_own_options_and_writes_them_back(tmp_path: Path) -> None:
    users = tmp_path / "pass word"
    users.write_text("")
    spec = parse_listener(
        f"mqtt://127.0.0.1:1883?max_connections=5&max_qos=1&allow_anonymous=false&password_file={users}"
    )
    assert (spec.max_connections, spec.max_qos, spec.allow_anonymous, spec.password_file) == (5, 1, False, str(users))
    assert parse_listener(spec.text()) == spec


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tcp://:1883", "scheme must be one of"),
        ("mqtt://:99999", "the port must be"),
        ("mqtt://:1883?max_conections=5", "did you mean 'max_connections'"),
        ("mqtt://:1883?max_qos=3", "max_qos: must be"),
        ("mqtts://:8883", "needs certfile and keyfile"),
        ("mqtt://:1883?require_certificate=true", "needs certfile"),
        ("mqtt://:1883?protocol=websockets", "contradicts the scheme"),
        ("mqtt://::1:1883", "an IPv6 address goes in brackets"),
        ("mqtt://:1883?password_file=/nonexistent/users", "cannot read"),
    ],
)
def test_a_bad_listener_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(SettingError, match=says):
        parse_listener(text)


def test_tls_options_of_a_listener_need_each_other(certs: Certs) -> None:
    cert, key = certs.server()
    with pytest.raises(SettingError, match="keyfile"):
        parse_listener(f"mqtts://:8883?certfile={cert}")
    with pytest.raises(SettingError, match="require_certificate needs cafile"):
        parse_listener(f"mqtts://:8883?certfile={cert}&keyfile={key}&require_certificate=true")
    with pytest.raises(SettingError, match="use_identity_as_username needs require_certificate"):
        parse_listener(f"mqtts://:8883?certfile={cert}&keyfile={key}&cafile={certs.ca_file}&use_identity_as_username=1")
    spec = parse_listener(f"mqtts://:8883?certfile={cert}&keyfile={key}&tls_version=tlsv1.3")
    assert spec.tls and ListenerConfig.load(spec).tls is not None


def test_a_listener_whose_key_does_not_match_is_refused_naming_it(certs: Certs, tmp_path: Path) -> None:
    cert, _ = certs.server()
    other = tmp_path / "other.key"
    other.write_text(Path(certs.client("device-7")[1]).read_text())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "servers.heartbeat",
            "--listener",
            f"mqtts://127.0.0.1:0?certfile={cert}&keyfile={other}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--listener" in lines[0] and "mqtts://127.0.0.1:0" in lines[0] and "do not load" in lines[0]


# -- several listeners in one server (both engines) ---------------------------------


def _listeners(*specs: ListenerSpec) -> list[ListenerConfig]:
    return [ListenerConfig.load(spec) for spec in specs]


async def test_each_listener_keeps_its_own_rules_in_one_broker(clock: MockClock, tmp_path: Path) -> None:
    users = PasswordFile.from_lines([])
    users.set("alice", b"s3cret", iterations=1000)
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite devices/#\n")
    config = HeartbeatConfig(
        max_idle=None,
        listeners=[
            ListenerConfig(ListenerSpec(port=0, address="127.0.0.1", max_connections=1)),
            ListenerConfig(
                ListenerSpec(port=0, address="127.0.0.1", allow_anonymous=False, allow_zero_length_clientid=False),
                auth=users,
                acl=AclFile.load(acl),
            ),
        ],
    )
    async with running(config) as (server, events):
        open_door, locked = server.doors
        assert open_door.port != locked.port and server.port == open_door.port
        # The first: anyone, one at a time.
        watcher = await Client.connect(open_door.port, "watcher", keep_alive=0)
        await Client.connect(open_door.port, "second", keep_alive=0, expect=3)
        # The second: its own password file, no anonymous clients, no empty client ids.
        await Client.connect(locked.port, "anon", keep_alive=0, expect=5)
        await Client.connect(locked.port, "", keep_alive=0, username="alice", password=b"s3cret", expect=2)
        alice = await Client.connect(locked.port, "alice-1", keep_alive=0, username="alice", password=b"s3cret")
        # One broker: the first listener's subscriber hears the second's publisher...
        await watcher.send(encoders.encode_subscribe(1, [("devices/#", 0)]))
        assert (await watcher.read_packet())[0] == 0x90
        await alice.send(encoders.encode_publish("devices/alice-1/t", b"21", qos=0))
        await alice.send(encoders.encode_publish("elsewhere/t", b"x", qos=0))  # the ACL drops it
        assert publish_topic(await watcher.read_packet()) == ("devices/alice-1/t", b"21")
        await alice.send(encoders.encode_pingreq())
        assert await alice.read(2) == encoders.encode_pingresp()
        assert server.counters["denied_publishes"] == 1
        assert (open_door.online, locked.online, open_door.refused, locked.refused) == (1, 1, 1, 2)
        metrics = server.metrics().decode()
        assert f'heartbeat_listener_devices_online{{listener="{locked.name}",worker="0"}} 1.0' in metrics
        assert f'heartbeat_listener_refused_total{{listener="{locked.name}",worker="0"}} 2.0' in metrics
    online = {e.client_id: e.listener for e in events if e.status == "online"}
    assert online == {"watcher": open_door.name, "alice-1": locked.name}
    assert {e.to_dict()["listener"] for e in events if e.status == "offline"} == {open_door.name, locked.name}


async def test_a_listener_of_its_own_max_qos_grants_no_more(clock: MockClock) -> None:
    config = HeartbeatConfig(
        listeners=_listeners(
            ListenerSpec(port=0, address="127.0.0.1"), ListenerSpec(port=0, address="127.0.0.1", max_qos=0)
        )
    )
    async with running(config) as (server, _):
        for door, granted in zip(server.doors, (2, 0), strict=True):
            client = await Client.connect(door.port, f"c{door.port}")
            await client.send(encoders.encode_subscribe(1, [("a/b", 2)]))
            suback = await client.read_packet()
            assert suback[-1] == granted


def test_a_second_server_on_a_listener_port_is_refused_naming_it() -> None:
    taken = free_port()
    first = start_heartbeat(free_port(), extra=["--listener", f"mqtt://127.0.0.1:{taken}"])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "servers.heartbeat", "--port", str(free_port()), "--listener", f"mqtt://127.0.0.1:{taken}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "--listener" in proc.stderr and "already in use" in proc.stderr
    finally:
        stop(first)


# -- real clients on every kind of listener, both engines, one worker and two -------


def paho_connect(
    port: int,
    client_id: str,
    *,
    ws: bool = False,
    tls: tuple[str, tuple[str, str] | None] | None = None,
    username: str | None = None,
    password: str | None = None,
) -> int:
    """Connect with paho (MQTT 3.1.1) and return the CONNACK's code (-1: no answer)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, transport="websockets" if ws else "tcp")
    if ws:
        client.ws_set_options(path="/mqtt")
    if tls is not None:
        ca, cert = tls
        client.tls_set(ca_certs=ca, certfile=cert[0] if cert else None, keyfile=cert[1] if cert else None)
    if username is not None:
        client.username_pw_set(username, password)
    answered = threading.Event()
    codes: list[int] = []

    def on_connect(_c: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        codes.append(int(rc.value if hasattr(rc, "value") else rc))  # type: ignore[arg-type]
        answered.set()

    client.on_connect = on_connect
    try:
        client.connect("127.0.0.1", port, keepalive=30)
    except OSError:
        return -1
    client.loop_start()
    try:
        answered.wait(15)
    finally:
        client.disconnect()
        client.loop_stop()
    return codes[0] if codes else -1


@pytest.fixture
def ports() -> Iterator[list[int]]:
    yield [free_port() for _ in range(4)]


@pytest.mark.parametrize(("engine", "workers"), [("dense", 1), ("streams", 1), ("dense", 2)])
def test_plain_tls_and_websocket_listeners_serve_real_clients_at_once(
    engine: str, workers: int, certs: Certs, tmp_path: Path, ports: list[int]
) -> None:
    cert, key = certs.server()
    users = tmp_path / "users"
    bob = PasswordFile()
    bob.set("bob", b"hunter2", iterations=1000)
    bob.save(str(users))
    tls = f"certfile={cert}&keyfile={key}"
    log = tmp_path / "presence.jsonl"
    plain, mtls, ws, wss = ports
    listeners = [
        f"mqtt://127.0.0.1:{plain}",
        f"mqtts://127.0.0.1:{mtls}?{tls}&cafile={certs.ca_file}&require_certificate=true&use_identity_as_username=true",
        f"ws://127.0.0.1:{ws}?password_file={users}",
        f"wss://127.0.0.1:{wss}?{tls}",
    ]
    extra = ["--engine", engine, "--presence-log", str(log)]
    for text in listeners:
        extra += ["--listener", text]
    # The first is also the --port start_heartbeat gives: the same address and port are one listener.
    proc = start_heartbeat(plain, workers=workers, extra=extra)
    try:
        ca = certs.ca_file
        assert paho_connect(plain, "plain-1") == 0
        assert paho_connect(mtls, "cert-1", tls=(ca, certs.client("device-7"))) == 0
        assert paho_connect(mtls, "no-cert", tls=(ca, None)) == -1  # refused at the handshake
        assert paho_connect(ws, "ws-anon", ws=True) == 135  # paho names 3.1.1 code 5 as 5.0 does
        assert paho_connect(ws, "ws-bob", ws=True, username="bob", password="hunter2") == 0
        assert paho_connect(wss, "wss-1", ws=True, tls=(ca, None)) == 0
    finally:
        stop(proc)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    came = {e["client_id"]: e["listener"] for e in events if e["status"] == "online"}
    assert came == {
        "plain-1": f"mqtt://127.0.0.1:{plain}",
        "cert-1": f"mqtts://127.0.0.1:{mtls}",
        "ws-bob": f"ws://127.0.0.1:{ws}",
        "wss-1": f"wss://127.0.0.1:{wss}",
    }
    assert [e.get("username") for e in events if e["client_id"] == "cert-1"] == ["device-7", "device-7"]
    offline = [e for e in events if e["status"] == "offline"]
    assert sorted(e["client_id"] for e in offline) == sorted(came)


def test_a_fleet_of_gateways_with_two_listeners_each_is_one_broker(tmp_path: Path) -> None:
    from .redis_server import RedisServer, require_binary

    redis = RedisServer(binary=require_binary())
    redis.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        gateways = []
        for name in ("gw0", "gw1"):
            port, ws = free_port(), free_port()
            log = tmp_path / f"{name}.jsonl"
            extra = ["--cluster", redis.url, "--node", name, "--presence-log", str(log)]
            extra += ["--listener", f"ws://127.0.0.1:{ws}"]
            procs.append(start_heartbeat(port, extra=extra))
            gateways.append((port, ws, log))
        (port0, ws0, _), (port1, ws1, _) = gateways
        heard: list[tuple[str, bytes]] = []
        watcher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="watcher", transport="websockets")
        watcher.ws_set_options(path="/mqtt")
        subscribed = threading.Event()
        watcher.on_subscribe = lambda *_: subscribed.set()
        watcher.on_message = lambda _c, _u, m: heard.append((m.topic, bytes(m.payload)))
        watcher.connect("127.0.0.1", ws1)
        watcher.loop_start()
        try:
            watcher.subscribe("$SYS/presence/#")
            assert subscribed.wait(15)
            assert paho_connect(port0, "tcp-device") == 0
            assert paho_connect(ws0, "ws-device", ws=True) == 0
            assert paho_connect(port1, "other-device") == 0
            for _ in range(150):
                seen = {json.loads(p).get("client_id") for _, p in heard if json.loads(p)["status"] == "offline"}
                if {"tcp-device", "ws-device", "other-device"} <= seen:
                    break
                threading.Event().wait(0.1)
        finally:
            watcher.disconnect()
            watcher.loop_stop()
        listeners: dict[str, set[str]] = {}
        for _, payload in heard:
            event = json.loads(payload)
            listeners.setdefault(event["client_id"], set()).add(event["listener"])
        assert listeners["tcp-device"] == {f"mqtt://127.0.0.1:{port0}"}
        assert listeners["ws-device"] == {f"ws://127.0.0.1:{ws0}"}
        assert listeners["other-device"] == {f"mqtt://127.0.0.1:{port1}"}
    finally:
        for proc in procs:
            stop(proc)
        redis.stop()


async def test_sighup_reloads_each_listeners_own_files_and_says_what_changed(
    clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    users_file, acl_file = tmp_path / "users", tmp_path / "acl"
    users = PasswordFile()
    users.set("alice", b"one", iterations=1000)
    users.set("bob", b"two", iterations=1000)
    users.save(str(users_file))
    acl_file.write_text("user alice\ntopic write a/#\n")
    spec = ListenerSpec(port=0, address="127.0.0.1", password_file=str(users_file), acl_file=str(acl_file))
    config = HeartbeatConfig(max_idle=None, listeners=[ListenerConfig.load(spec)])
    async with running(config) as (server, _):
        (door,) = server.doors
        await Client.connect(door.port, "a1", keep_alive=0, username="bob", password=b"two")
        users.set("alice", b"changed", iterations=1000)
        users.remove("bob")
        users.set("carol", b"three", iterations=1000)
        users.save(str(users_file))
        acl_file.write_text("user alice\ntopic write a/#\ntopic write b/#\n")
        caplog.set_level("WARNING", logger="servers.heartbeat")
        assert server.reload_files()
        said = caplog.text
        assert f"password file of listener {door.name} reloaded: 2 users (1 added, 1 removed, 1 changed)" in said
        assert f"ACL file of listener {door.name} reloaded: 2 rules (1 added, 0 removed)" in said
        await Client.connect(door.port, "a2", keep_alive=0, username="bob", password=b"two", expect=4)
        await Client.connect(door.port, "a3", keep_alive=0, username="carol", password=b"three")
        acl_file.write_text("frobnicate all/#\n")
        assert not server.reload_files()  # a broken file keeps the rules in force
        assert door.acl is not None and len(door.acl.rules) == 2


def test_a_listener_that_cannot_be_opened_is_refused_in_one_line_naming_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "servers.heartbeat", "--listener", "mqtt://127.0.0.1:0?bind_interface=nonexist0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "listener mqtt://127.0.0.1:0 (bind_interface nonexist0)" in lines[0] and "No such device" in lines[0]


def test_socket_domain_must_agree_with_the_address() -> None:
    with pytest.raises(SettingError, match=r"socket_domain ipv6 does not go with the address 127\.0\.0\.1"):
        parse_listener("mqtt://127.0.0.1:1883?socket_domain=ipv6")
    assert parse_listener("mqtt://:1883?socket_domain=ipv6").socket_domain == "ipv6"


@pytest.mark.skipif(os.geteuid() != 0, reason="SO_BINDTODEVICE needs root (CI runs as root)")
async def test_a_listener_bound_to_the_loopback_interface_serves_it(clock: MockClock) -> None:
    config = HeartbeatConfig(listeners=_listeners(ListenerSpec(port=0, address="127.0.0.1", bind_interface="lo")))
    async with running(config) as (server, _):
        client = await Client.connect(server.port, "on-lo")
        await client.send(encoders.encode_pingreq())
        assert await client.read(2) == encoders.encode_pingresp()
