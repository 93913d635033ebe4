"""A production-shaped ``mosquitto.conf`` run by Mosquitto and by this server in the same
test: three listeners (plain MQTT, TLS with client certificates standing for the
username, WebSockets), a password file made by ``mosquitto_passwd`` and an ACL file;
the same clients must get the same answers from both, and the same messages."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from loadtest.mqtt_targets import mosquitto_binary
from loadtest.processes import free_port, start_heartbeat, wait_listening

from .test_tls_servers import Certs, certs, stop

__all__ = ["certs"]

pytestmark = [
    pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto is not installed (apt-get install mosquitto)"),
    pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd is not installed"),
]

CONF = """\
# A box's broker: devices on 1883 and 8883 (client certificates), dashboards on WebSockets.
# Run as root (the tests, CI), Mosquitto would drop to the "mosquitto" user, who cannot
# read the test's private directory; this server never changes its user, and warns.
user root
per_listener_settings false
allow_anonymous false
password_file {users}
acl_file {acl}
persistence false
max_keepalive 300
max_inflight_messages 20

listener {plain} 127.0.0.1

listener {tls} 127.0.0.1
certfile {cert}
keyfile {key}
cafile {ca}
require_certificate true
use_identity_as_username true

listener {ws} 127.0.0.1
protocol websockets
"""

ACL = """\
# Each device writes under its own name; the dashboard reads everything.
pattern write devices/%u/#
user dashboard
topic read #
"""


@dataclass
class Box:
    """Where a broker of the test listens."""

    plain: int
    tls: int
    ws: int


@pytest.fixture
def files(tmp_path: Path) -> Path:
    users = tmp_path / "users"
    for name, password in (("alice", "wonderland"), ("dashboard", "glass")):
        create = ["-c"] if not users.exists() else []
        subprocess.run(["mosquitto_passwd", *create, "-b", str(users), name, password], check=True, timeout=30)
    (tmp_path / "acl").write_text(ACL)
    return tmp_path


def conf(where: Path, box: Box, certs: Certs) -> Path:
    cert, key = certs.server()
    path = where / f"mosquitto-{box.plain}.conf"
    text = CONF.format(
        users=where / "users",
        acl=where / "acl",
        plain=box.plain,
        tls=box.tls,
        ws=box.ws,
        cert=cert,
        key=key,
        ca=certs.ca_file,
    )
    path.write_text(text)
    return path


@dataclass
class Outcome:
    """What one client saw: its CONNACK code (-1: none, the handshake failed) and, for a
    subscriber, the topics it was sent."""

    code: int
    heard: tuple[str, ...] = ()


def client(
    box: Box,
    client_id: str,
    *,
    where: str = "plain",
    user: tuple[str, str] | None = None,
    cert: tuple[str, str] | None = None,
    certs: Certs | None = None,
    v5: bool = False,
) -> tuple[mqtt.Client, threading.Event, list[int], list[str]]:
    version = MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=version,
        transport="websockets" if where == "ws" else "tcp",
    )
    if where == "ws":
        c.ws_set_options(path="/mqtt")
    if where == "tls":
        assert certs is not None
        c.tls_set(ca_certs=certs.ca_file, certfile=cert[0] if cert else None, keyfile=cert[1] if cert else None)
    if user is not None:
        c.username_pw_set(*user)
    answered = threading.Event()
    codes: list[int] = []
    heard: list[str] = []

    def on_connect(_c: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        codes.append(int(getattr(rc, "value", rc)))  # type: ignore[call-overload]
        answered.set()

    c.on_connect = on_connect
    c.on_message = lambda _c, _u, m: heard.append(m.topic)
    port = {"plain": box.plain, "tls": box.tls, "ws": box.ws}[where]
    try:
        c.connect("127.0.0.1", port, keepalive=30)
    except OSError:
        answered.set()
    c.loop_start()
    return c, answered, codes, heard


def outcomes(box: Box, certs: Certs) -> dict[str, Outcome]:
    """Every client of the script against ``box``: who gets in, and what the dashboard hears."""
    alice = ("alice", "wonderland")
    device = certs.client("device-7")
    attempts: dict[str, dict[str, object]] = {
        "plain, anonymous": {},
        "plain, alice": {"user": alice},
        "plain, alice's wrong password": {"user": ("alice", "rabbit")},
        "plain, a stranger": {"user": ("mallory", "x")},
        "plain, anonymous, 5.0": {"v5": True},
        "plain, alice's wrong password, 5.0": {"user": ("alice", "rabbit"), "v5": True},
        "tls, a client certificate": {"where": "tls", "cert": device},
        "tls, no certificate": {"where": "tls"},
        "ws, anonymous": {"where": "ws"},
        "ws, alice": {"where": "ws", "user": alice},
    }
    out: dict[str, Outcome] = {}
    stops: list[Callable[[], object]] = []
    try:
        dash, ready, codes, heard = client(box, "dash", where="ws", user=("dashboard", "glass"))
        stops.append(dash.loop_stop)
        assert ready.wait(15) and codes == [0], codes
        subscribed = threading.Event()
        dash.on_subscribe = lambda *_: subscribed.set()
        dash.subscribe("devices/#", qos=1)
        assert subscribed.wait(15)
        publishers = {}
        for name, kw in attempts.items():
            client_id = name.replace(" ", "-").replace(",", "").replace("'", "")
            c, answered, got, _ = client(box, client_id, certs=certs, **kw)  # type: ignore[arg-type]
            stops.append(c.loop_stop)
            answered.wait(15)
            out[name] = Outcome(got[0] if got else -1)
            if got == [0]:
                publishers[name] = c
            else:  # at once: paho would try again and again, and hammer both brokers
                c.disconnect()
                c.loop_stop()
        # Each admitted client writes under alice's name, under device-7's, and elsewhere.
        for c in publishers.values():
            for topic in ("devices/alice/t", "devices/device-7/t", "elsewhere/t"):
                c.publish(topic, b"1", qos=1).wait_for_publish(10)
        time.sleep(1.0)
        out["the dashboard heard"] = Outcome(0, tuple(sorted(heard)))
    finally:
        for halt in stops:
            halt()
    return out


@pytest.fixture
def boxes() -> Iterator[tuple[Box, Box]]:
    yield Box(free_port(), free_port(), free_port()), Box(free_port(), free_port(), free_port())


def test_the_same_mosquitto_conf_gives_the_same_answers_on_both_brokers(
    files: Path, certs: Certs, boxes: tuple[Box, Box]
) -> None:
    theirs, ours = boxes
    binary = mosquitto_binary()
    assert binary is not None
    mosquitto = subprocess.Popen([binary, "-c", str(conf(files, theirs, certs))], stderr=subprocess.PIPE, text=True)
    try:
        for port in (theirs.plain, theirs.tls, theirs.ws):
            wait_listening(port, mosquitto)
        expected = outcomes(theirs, certs)
    finally:
        stop(mosquitto)
    server = start_heartbeat(ours.plain, extra=["-c", str(conf(files, ours, certs))])
    try:
        got = outcomes(ours, certs)
    finally:
        stop(server)
    # One difference, written down (docs/how-to/from-mosquitto.md): a wrong password or an
    # unknown user is "bad user name or password" here (MQTT's own code, 4 or 0x86),
    # where Mosquitto 2.0 says "not authorized" (5 or 0x87).
    wrong = ("plain, alice's wrong password", "plain, a stranger", "plain, alice's wrong password, 5.0")
    for name in wrong:
        assert (expected[name].code, got[name].code) == (135, 134), name
    assert {k: v for k, v in got.items() if k not in wrong} == {k: v for k, v in expected.items() if k not in wrong}
    # What the script means: the refusals refuse, and the ACL holds on every listener.
    assert expected["plain, alice"].code == 0 and expected["plain, anonymous"].code != 0
    assert expected["tls, no certificate"].code == -1
    assert expected["the dashboard heard"].heard == (
        "devices/alice/t",
        "devices/alice/t",
        "devices/device-7/t",
    )
