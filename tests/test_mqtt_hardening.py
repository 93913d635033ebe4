"""Hardening against hostile clients, against the server as its own process: a refused
CONNECT under an online device's client id must not touch that device's presence, and
strings with U+0000, control characters or non-characters are refused before they can
reach subscribers. Wall clock, short timeouts; every server is stopped by its PID (the
``start_server`` fixture)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.packets import ProtocolError
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.presence.event import REFUSED, PresenceEvent

from .conftest import wait_closed
from .test_heartbeat_clients import IN_CI, ROOT, Server, start_server
from .test_mqtt_state import Raw

__all__ = ["start_server"]  # the fixture, used here by name

ENGINES = ["dense", "streams"]
PINGRESP = b"\xd0\x00"


def auth_file(tmp_path: Path, users: dict[str, str]) -> Path:
    """A password file made with the CLI, as an operator would."""
    target = tmp_path / "users"
    for user, password in users.items():
        subprocess.run(
            [sys.executable, "-m", "servers.heartbeat.auth", "add", str(target), user, "--iterations", "1000"],
            input=password + "\n",
            text=True,
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return target


def device_record(server: Server, client_id: str) -> dict[str, object] | None:
    """``/devices/<client-id>`` from the status endpoint; None for 404."""
    assert server.status_port is not None
    url = f"http://127.0.0.1:{server.status_port}/devices/{client_id}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def still_alive(client: Raw) -> bool:
    client.send(b"\xc0\x00")  # PINGREQ
    return client.read_packet() == PINGRESP


# -- 1. a refused CONNECT touches nobody's presence ------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_connect_under_an_online_id_touches_nobodys_presence(
    start_server: object, tmp_path: Path, engine: str
) -> None:
    users = auth_file(tmp_path, {"dev": "right", "watch": "eyes"})
    # 21 wrong passwords from one address: past the throttle's free failures, its CONNECTs
    # (late's right one too) would be refused unchecked for a while: not this test's subject.
    server: Server = start_server(  # type: ignore[operator]
        "--engine", engine, "--auth-file", str(users), "--auth-free-failures", "100", status=True
    )
    victim = Raw(server.port, "victim", username="dev", password=b"right")
    assert victim.connack == encoders.encode_connack(False, 0)
    watcher = Raw(server.port, "watcher", username="watch", password=b"eyes")
    assert watcher.subscribe(f"{PRESENCE}#", 0)[0] == 0x90
    before = {p.topic: json.loads(p.payload) for p in watcher.drain()}  # the retained ones
    assert before[f"{PRESENCE}victim"]["status"] == "online"
    record = device_record(server, "victim")
    assert record is not None and record["status"] == "online"

    attacker = Raw(server.port, "victim", username="dev", password=b"wrong")
    assert attacker.connack == encoders.encode_connack(False, 4)
    wait_closed(attacker.sock, 3.0)  # TimeoutError if the server keeps it open
    # And a flood of refused attempts under made-up ids.
    for i in range(20):
        ghost = Raw(server.port, f"ghost-{i}", username="nobody", password=b"x")
        assert ghost.connack == encoders.encode_connack(False, 4)
        ghost.sock.close()

    refusals = server.wait_for(lambda e: e["status"] == REFUSED and e.get("claimed_client_id") == "victim")
    assert refusals[0]["client_id"] is None and refusals[0]["reason"] == "refused"
    assert str(refusals[0]["detail"]).startswith("bad-credentials")
    server.wait_for(lambda e: e.get("claimed_client_id") == "ghost-19")
    events = server.events()
    assert [e["status"] for e in events if e["client_id"] == "victim"] == ["online"]
    assert not any(e["status"] == "offline" and e["client_id"] is not None for e in events)
    # Its record and retained presence are as they were; refusals made no records.
    after = device_record(server, "victim")
    assert after is not None and after["status"] == "online" and after["epoch"] == record["epoch"]
    assert all(device_record(server, f"ghost-{i}") is None for i in (0, 19))
    assert watcher.quiet_for(0.5)  # no presence message for anyone
    late = Raw(server.port, "late", username="watch", password=b"eyes")
    late.subscribe(f"{PRESENCE}victim", 0)
    (retained,) = late.drain()
    assert json.loads(retained.payload)["status"] == "online"
    assert json.loads(retained.payload)["epoch"] == record["epoch"]
    # The victim saw nothing and is still connected.
    assert victim.quiet_for(0.1)
    assert still_alive(victim)
    for c in (victim, watcher, late):
        c.close()


def test_a_refusal_event_round_trips_and_names_no_device() -> None:
    event = PresenceEvent(
        REFUSED, None, "1.2.3.4:5", Offline.REFUSED, 0.0, 1.0, detail="bad-credentials", claimed_client_id="victim"
    )
    data = event.to_dict()
    assert data["client_id"] is None and data["claimed_client_id"] == "victim" and data["status"] == "refused"
    assert PresenceEvent.from_dict(json.loads(json.dumps(data))) == event
    online = PresenceEvent("online", "d", "?", None, 0.0, 1.0)
    assert "claimed_client_id" not in online.to_dict()


# -- 2. strings that would knock out subscribers ----------------------------------------

BAD_CHARS = ["\x01", "\x1b", "\x1f", "\x7f", "\x85", "\x9f", "\ufdd0", "\ufdef", "\ufffe", "\uffff", "\U0010ffff"]
GOOD_CHARS = [" ", "~", "\xa0", "é", "\ufdcf", "\ufdf0", "\ufffd", "日", "\U0001f600"]


def _connect_error(**kw: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        PacketReader().feed(encoders.encode_connect(**kw))  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize("char", BAD_CHARS)
def test_reader_refuses_control_and_noncharacters_in_every_string_field(char: str) -> None:
    bad = f"a{char}b"
    error = _connect_error(client_id=bad)
    assert (error.reason, error.connack_code) == ("identifier-rejected", 2)
    for kw in ({"will_topic": bad, "will_message": b"x"}, {"username": bad}):
        error = _connect_error(client_id="ok", **kw)
        assert error.reason == "forbidden-character" and error.connack_code is None
    for wire in (
        encoders.encode_publish(bad, b"payload"),
        encoders.encode_publish(bad, b"payload", qos=1, packet_id=1),
        encoders.encode_subscribe(1, [(bad, 0)]),
        encoders.encode_subscribe(1, [(f"{bad}/#", 0)]),
        encoders.encode_unsubscribe(1, [bad]),
    ):
        with pytest.raises(ProtocolError) as info:
            PacketReader().feed(wire)
        assert info.value.reason == "forbidden-character" and info.value.connack_code is None
        assert f"U+{ord(char):04X}" in info.value.detail


@pytest.mark.parametrize("char", GOOD_CHARS)
def test_reader_keeps_printable_text_and_leaves_payloads_alone(char: str) -> None:
    text = f"a{char}b"
    (connect,) = PacketReader().feed(encoders.encode_connect(text, username=text, password=b"\x00\x01"))
    assert connect.client_id == text and connect.username == text  # type: ignore[union-attr]
    (publish,) = PacketReader().feed(encoders.encode_publish(text, b"\x00\x01\x1b\xff"))
    assert publish.topic == text and publish.payload == b"\x00\x01\x1b\xff"  # type: ignore[union-attr]


def test_reader_nul_is_a_protocol_error_without_connack_in_every_field() -> None:
    for kw in ({"client_id": "a\x00"}, {"client_id": "ok", "username": "u\x00"}):
        error = _connect_error(**kw)
        assert error.reason == "invalid-utf8" and error.connack_code is None


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("char", ["\x1b", "\x85", "\uffff"])
def test_a_connect_with_a_control_character_in_its_client_id_gets_connack_2(
    start_server: object, engine: str, char: str
) -> None:
    server: Server = start_server("--engine", engine)  # type: ignore[operator]
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(5)
    sock.sendall(encoders.encode_connect(f"dev{char}x", keep_alive=30))
    assert sock.recv(4) == encoders.encode_connack(False, 2)
    wait_closed(sock, 3.0)  # TimeoutError if the server keeps it open
    sock.close()
    # Nobody named after it: no presence, no record.
    late = Raw(server.port, "late")
    late.subscribe(f"{PRESENCE}#", 0)
    assert [p.topic for p in late.drain()] == [f"{PRESENCE}late"]
    late.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_publish_or_subscribe_with_a_control_character_closes_only_that_connection(
    start_server: object, engine: str
) -> None:
    server: Server = start_server("--engine", engine)  # type: ignore[operator]
    sub = Raw(server.port, "sub")
    sub.subscribe("#", 0)
    assert sub.drain() == []  # no retained presence: "#" does not match $SYS/presence/...
    for i, wire in enumerate(
        [
            encoders.encode_publish("room/\x1b[2Jboom", b"x"),
            encoders.encode_publish("room/\x00nul", b"x"),
            encoders.encode_publish("room/\ufffe", b"x", qos=1, packet_id=1),
            encoders.encode_subscribe(1, [("room/\x07/#", 0)]),
        ]
    ):
        bad = Raw(server.port, f"bad-{i}")
        bad.send(wire)
        wait_closed(bad.sock, 3.0)  # TimeoutError if the server keeps it open
        bad.sock.close()
    ok = Raw(server.port, "ok")
    ok.send(encoders.encode_publish("room/fine", b"payload \x00\x1b kept"))
    got = [(p.topic, p.payload) for p in sub.drain()]
    assert got == [("room/fine", b"payload \x00\x1b kept")]  # nothing else reached the subscriber, presence neither
    assert still_alive(sub)
    errors = server.wait_for(lambda e: e["reason"] == "protocol-error" and e["client_id"] == "bad-3")
    assert errors[0]["detail"] == "forbidden-character"
    details = {e["client_id"]: e["detail"] for e in server.events() if e["reason"] == "protocol-error"}
    assert details == {
        "bad-0": "forbidden-character",
        "bad-1": "invalid-utf8",
        "bad-2": "forbidden-character",
        "bad-3": "forbidden-character",
    }
    ok.close()
    sub.close()


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None and not IN_CI, reason="mosquitto-clients not installed")
def test_mosquitto_sub_never_sees_an_escape_sequence_topic(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    proc = subprocess.Popen(
        ["mosquitto_sub", "-V", "mqttv311", "-h", "127.0.0.1", "-p", str(server.port), "-v", "-t", "room/#", "-C", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)  # subscribed
        bad = Raw(server.port, "bad")
        bad.send(encoders.encode_publish("room/\x1b]0;pwned\x07", b"x"))
        wait_closed(bad.sock, 3.0)  # TimeoutError if the server keeps it open
        bad.sock.close()
        ok = Raw(server.port, "ok")
        ok.send(encoders.encode_publish("room/fine", b"hello"))
        out, _ = proc.communicate(timeout=5)
        assert out == "room/fine hello\n"
        ok.close()
    finally:
        if proc.poll() is None:
            proc.kill()  # by PID
            proc.wait()
