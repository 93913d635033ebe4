"""MQTT 5.0 in the device load tester: the ``--protocol`` option and its mixes, the 5.0
device's client logic against the server's own codec (its CONNECT, the CONNACK with a
Server Keep Alive that changes its ping period, a DISCONNECT counted by reason code),
the results and report, compare's 5.0 rows; and short runs against Mosquitto (5.0 and a
mixed fleet, and a Server Keep Alive honoured for real) and against our server."""

from __future__ import annotations

import json
import math
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.compare import ours_for, row_name, versions
from loadtest.device_results import merge, passed, protocol_lines, report
from loadtest.devices import parser
from loadtest.generator.events import Generator
from loadtest.generator.mqtt5 import RECEIVE_MAXIMUM, disconnect_reasons, encode_connect, read_connack, reason_label
from loadtest.generator.records import HANDSHAKE, ONLINE, Conn, Device
from loadtest.generator.report import generator_results
from loadtest.generator.results import judge_devices
from loadtest.generator.spec import GeneratorSpec, write_spec
from loadtest.mqtt_targets import MqttTarget, mosquitto_binary, start_mosquitto
from loadtest.mqtt_versions import canonical, deal, parse_mix
from loadtest.processes import free_port
from loadtest.report import table
from loadtest.sampler import Sample
from loadtest.workload import DeviceLoad, Timeline, plan, specs
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.v5.codec import pack, read_packet
from servers.heartbeat.mqtt.v5.packets import Connack, Connect, Disconnect
from servers.heartbeat.mqtt.v5.properties import Properties

ROOT = Path(__file__).resolve().parent.parent

needs_mosquitto = pytest.mark.skipif(
    mosquitto_binary() is None,
    reason="mosquitto is not installed (apt-get install mosquitto; .ci/run installs it in CI)",
)


# -- the --protocol option ---------------------------------------------------------------


def test_a_protocol_is_one_version_or_a_mix_the_rest_3_1_1() -> None:
    assert parse_mix("5") == parse_mix("5.0") == {5: 1.0}
    assert parse_mix("3.1") == {3: 1.0} and parse_mix("3.1.1") == {4: 1.0}
    assert parse_mix("mixed") == parse_mix("5:0.5") == {4: 0.5, 5: 0.5}
    assert parse_mix("3.1:0.1,5:0.3") == pytest.approx({3: 0.1, 4: 0.6, 5: 0.3})
    assert parse_mix("3.1.1:0.25,5:0.75") == {4: 0.25, 5: 0.75}
    assert canonical("5:0.5") == "3.1.1:0.5,5.0:0.5" and canonical("5") == "5.0"
    for bad in ("4", "5:1.5", "5:0.7,3.1:0.5", "5,3.1", "3.1.1:0.2,5:0.2", "5:x", "5:0.2,5:0.1", ""):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_the_command_line_takes_the_syntax_and_refuses_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["--protocol", "mixed"]).protocol == "3.1.1:0.5,5.0:0.5"
    assert parser().parse_args([]).protocol == "3.1.1"
    with pytest.raises(SystemExit):
        parser().parse_args(["--protocol", "5:2"])
    assert "'5:2': the share must be from 0 to 1" in capsys.readouterr().err
    help_text = " ".join(parser().format_help().split())  # however wide the terminal
    assert "'mixed'" in help_text and "'5:0.5' is half 5.0" in help_text


def test_deal_gives_exact_counts_and_leaves_the_roles_as_they_were(tmp_path: Path) -> None:
    dealt = deal(1001, "3.1:0.1,5:0.3", seed=4)
    assert (dealt.count("3"), dealt.count("4"), dealt.count("5")) == (100, 601, 300)
    assert deal(1001, "3.1.1", seed=4) == ""  # the generators' default: no string to carry
    assert deal(10, "5", seed=1) == "5" * 10
    plain = DeviceLoad(devices=40_001, silent=0.1, reconnect=0.03, per_generator=15_000)
    mixed = DeviceLoad(devices=40_001, silent=0.1, reconnect=0.03, per_generator=15_000, protocol="mixed")
    timeline = plan(plain, 3)
    a, b = specs(plain, timeline, 1883, tmp_path), specs(mixed, timeline, 1883, tmp_path)
    assert [s.silent for s in a] == [s.silent for s in b] and [s.reconnect for s in a] == [s.reconnect for s in b]
    assert all(s.versions == "" for s in a)
    assert [len(s.versions) for s in b] == [s.count for s in b]
    assert sum(s.versions.count("5") for s in b) == 20_000  # 40,001 / 2, rounded down by the largest remainder


# -- the 5.0 device's packets, against the server's codec ------------------------------------


def test_a_5_0_connect_asks_for_no_session_and_a_receive_maximum() -> None:
    data = encode_connect("dev-7", 30)
    packet = read_packet(data[0], data[2:])
    assert isinstance(packet, Connect)
    assert packet.client_id == "dev-7" and packet.keep_alive == 30 and packet.clean_start
    assert packet.properties.session_expiry_interval == 0
    assert packet.properties.receive_maximum == RECEIVE_MAXIMUM
    assert packet.will is None and packet.username is None


def test_read_connack_knows_a_5_0_answer_from_a_3_x_one() -> None:
    told = pack(Connack(False, 0, Properties(server_keep_alive=7, receive_maximum=20)))
    answer = read_connack(told + b"\xd0\x00")
    assert answer is not None and answer.accepted and answer.server_keep_alive == 7
    assert answer.used == len(told) and answer.label == "5.0 CONNACK 0x00 success"
    refused = read_connack(pack(Connack(False, 0x84)))
    assert (
        refused is not None
        and not refused.accepted
        and refused.label == "5.0 CONNACK 0x84 unsupported-protocol-version"
    )
    # A server that does not serve 5.0 answers with a 3.1.1 CONNACK: "unacceptable protocol version".
    old = read_connack(encoders.encode_connack(False, 1))
    assert old is not None and not old.accepted and old.label == "3.x CONNACK 1"
    early = read_connack(pack(Disconnect(0x82)))
    assert early is not None and not early.accepted and early.label == "DISCONNECT 0x82 protocol-error"
    assert read_connack(told[:3]) is None  # not whole yet
    junk = read_connack(b"\x20\x03\x00\x00\x05")  # a property length past the end
    assert junk is not None and not junk.accepted and junk.label.startswith("malformed answer")


def test_disconnect_reasons_are_read_from_between_pingresps() -> None:
    data = b"\xd0\x00" + pack(Disconnect(0x8D)) + b"\xd0\x00" + pack(Disconnect(0x8E))[:2]
    reasons, used = disconnect_reasons(data)
    assert reasons == ["0x8D keep-alive-timeout"] and used == len(data) - 2
    assert disconnect_reasons(pack(Disconnect()))[0] == ["0x00 success"]
    assert reason_label(0x8B) == "0x8B server-shutting-down" and reason_label(0x03) == "0x03 unknown"


# -- the 5.0 device in a generator, over a real socket pair ----------------------------------


def _generator(tmp_path: Path, versions: str, keepalive: int = 10) -> Generator:
    spec = GeneratorSpec(
        index=0,
        host="127.0.0.1",
        port=1,
        source="127.0.0.2",
        first=0,
        count=len(versions),
        keepalive=keepalive,
        jitter=0.2,
        rate=1.0,
        max_inflight=1,
        start_at=math.inf,
        end_at=0.0,
        results=str(tmp_path / "r.json"),
        versions=versions,
    )
    return Generator(spec)


class _Pair:
    """A device's connection in its handshake, the server's end of it in our hands."""

    def __init__(self, g: Generator, device: Device) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.client = socket.create_connection(listener.getsockname())
            self.server, _ = listener.accept()
        self.client.setblocking(False)
        self.server.settimeout(2.0)
        self.g = g
        self.conn = Conn(device, self.client, 0)
        self.conn.phase = HANDSHAKE
        device.conn, device.last_sent = self.conn, time.monotonic()
        g.conns[self.client.fileno()] = self.conn
        g.epoll.register(self.client.fileno(), select.EPOLLIN)
        g.inflight += 1

    def answer(self, data: bytes) -> None:
        """The server sends ``data``; the generator reads it as its loop would."""
        self.server.sendall(data)
        assert self.g.epoll.poll(2.0)
        self.g.on_readable(self.conn, time.monotonic())

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def pairs() -> Iterator[list[_Pair]]:
    made: list[_Pair] = []
    yield made
    for p in made:
        p.close()


def test_a_server_keep_alive_sets_the_ping_period(tmp_path: Path, pairs: list[_Pair]) -> None:
    g = _generator(tmp_path, "55", keepalive=10)
    told, own = g.devices
    for device, props in ((told, Properties(server_keep_alive=1)), (own, Properties(receive_maximum=10))):
        pair = _Pair(g, device)
        pairs.append(pair)
        pair.answer(pack(Connack(False, 0, props)))
        assert device.conn is not None and device.conn.phase == ONLINE and device.timer is not None
    # The server's 1 s, less the jitter (at most 20%): never its own 10 s.
    assert told.keepalive == 1
    assert told.timer is not None and 0.8 <= told.timer.when - told.last_sent <= 1.0
    assert own.keepalive == 10
    assert own.timer is not None and 8.0 <= own.timer.when - own.last_sent <= 10.0
    r = generator_results(g)
    assert r["server_keepalive"] == {"1": 1} and r["protocols"] == {"5.0": 2} and r["connected"] == 2


def test_a_5_0_device_pings_and_counts_the_server_s_disconnect(tmp_path: Path, pairs: list[_Pair]) -> None:
    g = _generator(tmp_path, "54")
    v5, v311 = g.devices
    assert v5.pinger == g.ping_v5 and v311.pinger == g.ping  # the 3.1.1 heartbeat is the same as before
    pair = _Pair(g, v5)
    pairs.append(pair)
    pair.answer(pack(Connack(False, 0)))
    assert g.online == 1
    v5.role = "silent"
    pair.server.sendall(b"\xd0\x00")  # a PINGRESP: read at the next ping, not woken for
    g.ping_v5(v5)
    assert pair.server.recv(16) == b"\xc0\x00" and g.pings == 1
    pair.server.sendall(b"\xd0\x00" + pack(Disconnect(0x8D)))
    pair.server.shutdown(socket.SHUT_WR)
    assert g.epoll.poll(2.0)
    g.on_readable(pair.conn, time.monotonic())
    assert g.online == 0 and v5.conn is None and v5.closed_at == v5.closed_at
    r = generator_results(g)
    assert r["disconnects"] == {"0x8D keep-alive-timeout": {"silent": 1}}
    assert r["protocols"] == {"3.1.1": 1, "5.0": 1}


def test_a_disconnect_read_by_a_ping_is_counted_too(tmp_path: Path, pairs: list[_Pair]) -> None:
    g = _generator(tmp_path, "5")
    (device,) = g.devices
    pair = _Pair(g, device)
    pairs.append(pair)
    pair.answer(pack(Connack(False, 0)))
    pair.server.sendall(pack(Disconnect(0x98, Properties(reason_string="admin"))))
    pair.server.close()
    assert g.epoll.poll(2.0)  # the close has reached us; the ping comes before the loop looks
    g.ping_v5(device)  # reads the DISCONNECT on the way (one recv, as a 3.1.1 device's ping does)
    assert g.disconnects == {"0x98 administrative-action": {"healthy": 1}}
    g.on_readable(pair.conn, time.monotonic())  # then the loop hears the end
    assert device.conn is None and g.online == 0
    assert generator_results(g)["disconnects"] == {"0x98 administrative-action": {"healthy": 1}}


def test_a_refusal_is_counted_by_its_answer(tmp_path: Path, pairs: list[_Pair]) -> None:
    g = _generator(tmp_path, "543")
    for device, answer in zip(
        g.devices,
        (encoders.encode_connack(False, 1), encoders.encode_connack(False, 5), encoders.encode_connack(False, 2)),
        strict=True,
    ):
        pair = _Pair(g, device)
        pairs.append(pair)
        pair.answer(answer)
        assert device.conn is None
    r = generator_results(g)
    assert r["refused"] == 3 and r["connected"] == 0
    assert r["refusals"] == {"3.x CONNACK 1": 1, "3.x CONNACK 5": 1, "3.x CONNACK 2": 1}


def test_each_version_sends_its_own_connect(tmp_path: Path) -> None:
    g = _generator(tmp_path, "345", keepalive=7)
    packets = [g.connect_packet(d) for d in g.devices]
    assert packets[0][2:10] == b"\x00\x06MQIsdp" and packets[0][10] == 3
    assert packets[1][2:8] == b"\x00\x04MQTT" and packets[1][8] == 4
    v5 = read_packet(packets[2][0], packets[2][2:])
    assert isinstance(v5, Connect) and v5.keep_alive == 7


def test_a_device_is_judged_by_the_keep_alive_it_was_told() -> None:
    silent, healthy = Device(0, "dev-0", keepalive=2.0), Device(1, "dev-1", keepalive=2.0)
    for d in (silent, healthy):
        d.connack_at = d.connect_started = 0.0
        d.last_sent, d.max_gap = 100.0, 2.0
    silent.role, silent.acted_at, silent.closed_at = "silent", 100.5, 103.2
    healthy.closed_at = 102.0  # 2 s after its ping, inside its own 3 s window: the server's fault
    r = judge_devices([silent, healthy], window=15.0, failover=False)
    assert r["lateness"] == [pytest.approx(0.2)] and r["silent_window"] == {"dev-0": 3.0}
    assert [f["client_id"] for f in r["false_expiries"]] == ["dev-1"]


def test_the_report_shows_the_mix_the_refusals_and_the_reason_codes(tmp_path: Path) -> None:
    g = _generator(tmp_path, "3455")
    r = generator_results(g)
    r["connack_times"] = [float(t) for t in range(4)]
    r["refusals"] = {"5.0 CONNACK 0x87 not-authorized": 2}
    r["disconnects"] = {"0x8E session-taken-over": {"taken over": 3}}
    r["server_keepalive"] = {"10": 2}
    samples = [Sample(t=float(t), rss=1_000_000, cpu=0.0, fds=10, processes=1) for t in range(20)]
    timeline = Timeline(start=0.0, acts=10.0, detect_by=15.0, stall=None, stall_end=None, end=16.0)
    merged = merge(DeviceLoad(devices=4, keepalive=2, protocol="3.1:0.25,5:0.5"), timeline, [r, r], [], samples, {})
    assert merged["protocols"] == {"3.1": 2, "3.1.1": 2, "5.0": 4}
    assert merged["disconnects"] == {"0x8E session-taken-over": {"taken over": 6}}
    merged["target"] = "test"
    lines = protocol_lines(merged)
    assert lines[0] == "protocols              3.1 2, 3.1.1 2, 5.0 4 devices"
    assert "5.0 CONNACK 0x87 not-authorized 4" in lines[1]
    assert "10 s to 4" in lines[2]
    assert "0x8E session-taken-over 6 (taken over 6)" in lines[3]
    assert "protocols              3.1 2" in report(merged)


# -- compare: 5.0 rows beside the 3.1.1 rows ---------------------------------------------------


def test_compare_names_5_0_rows_and_takes_their_ratios_to_ours_on_5_0() -> None:
    assert versions("3.1.1,5") == ["3.1.1", "5.0"]
    with pytest.raises(ValueError, match="a mix"):
        versions("3.1.1,mixed")
    assert row_name("mosquitto", "3.1.1") == "mosquitto" and row_name("mosquitto", "5.0") == "mosquitto (5.0)"
    assert ours_for("mosquitto (5.0)") == "idlekeeper (5.0)" and ours_for("mosquitto") == "idlekeeper"
    rows = {
        "idlekeeper": {"x": 100.0},
        "mosquitto": {"x": 50.0},
        "idlekeeper (5.0)": {"x": 200.0},
        "mosquitto (5.0)": {"x": 50.0},
    }
    text = table(rows, (("x", "bytes", "B", False),), {"amqtt (5.0)": "speaks MQTT 3.1.1 only"}, ours_for)
    lines = text.splitlines()
    assert lines[3] == "| mosquitto | 50 B (0.50×) |"
    assert lines[5] == "| mosquitto (5.0) | 50 B (0.25×) |"
    assert lines[6].startswith("| amqtt (5.0) | not run: speaks MQTT 3.1.1 only |")


# -- runs against real servers ---------------------------------------------------------------


@pytest.fixture
def mosquitto(request: pytest.FixtureRequest) -> Iterator[MqttTarget]:
    extra = getattr(request, "param", "")
    started = start_mosquitto("mosquitto", free_port(), extra)
    yield started
    started.stop()
    assert started.proc.poll() is not None  # stopped by its PID


def _devices(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "devices.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "devices", *args, "--quiet", "--json", str(out), "--plots", ""],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    r: dict[str, object] = json.loads(out.read_text())
    assert "protocols " in done.stdout  # the report's line
    return r


@pytest.mark.bench
@needs_mosquitto
@pytest.mark.slow
def test_a_mixed_fleet_against_mosquitto(tmp_path: Path, mosquitto: MqttTarget) -> None:
    """1,000 devices, 3.1, 3.1.1 and 5.0, keep-alive 2 s, some vanishing and reconnecting.
    (None go silent: Mosquitto's keep-alive sweep, every 5-6 s, would find them after
    this short run ends.)"""
    r = _devices(
        tmp_path,
        *("--port", str(mosquitto.port), "--pid", str(mosquitto.proc.pid), "--protocol", "3.1:0.2,5:0.4"),
        *("--devices", "1000", "--keepalive", "2", "--silent", "0", "--vanish", "0.01", "--reconnect", "0.02"),
    )
    assert passed(r)
    assert r["protocols"] == {"3.1": 200, "3.1.1": 400, "5.0": 400}
    assert r["connected"] == 1000 and r["refused"] == 0 and r["refusals"] == {}
    assert r["false_expiries"] == 0
    assert r["takeover_missed"] == 0 and r["takeover_ms"]["n"] == 20  # type: ignore[index]
    assert r["heartbeats"] > 1000  # type: ignore[operator]


@pytest.mark.bench
@needs_mosquitto
@pytest.mark.slow
@pytest.mark.parametrize("mosquitto", ["max_keepalive 10\n"], indirect=True)
def test_devices_ping_at_mosquitto_s_server_keep_alive(tmp_path: Path, mosquitto: MqttTarget) -> None:
    """Devices that ask for no keep-alive (0) are told 10 s by Mosquitto (its max_keepalive,
    sent as a Server Keep Alive, its least) and must ping at it: Mosquitto drops a device
    silent for 15 s, so a device that kept to its own 0 would be gone by the end of these 16.5 s."""
    start = time.monotonic() + 0.2
    spec = GeneratorSpec(
        index=0,
        host="127.0.0.1",
        port=mosquitto.port,
        source="127.0.0.2",
        first=0,
        count=20,
        keepalive=0,
        jitter=0.2,
        rate=200.0,
        max_inflight=20,
        start_at=start,
        end_at=start + 16.5,
        results=str(tmp_path / "r.json"),
        versions="5" * 20,
    )
    path = tmp_path / "spec.json"
    write_spec(spec, path)
    # A process of its own, as a run has it (a generator turns the collector off).
    subprocess.run([sys.executable, "-m", "loadtest.generator", str(path)], check=True, timeout=60, cwd=ROOT)
    r = json.loads(Path(spec.results).read_text())
    assert r["connected"] == 20 and r["server_keepalive"] == {"10": 20}
    assert r["pings"] >= 20  # every 8-10 s: once each at least
    assert r["online_at_end"] == 20 and r["false_expiries"] == [] and r["generator_late"] == 0
