"""Both servers over TLS, as processes of their own, with real clients: httpx and curl
for HTTPS; mosquitto_pub/sub and paho-mqtt (``tls_set``) for MQTT on both engines,
with client certificates whose CN is the username. Wall clock, short timeouts,
every process stopped by its PID."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import paho.mqtt.client as mqtt
import pytest
import trio
import trio.testing
import trustme
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from loadtest.processes import free_port, start_heartbeat, start_http
from servers.heartbeat.__main__ import main as heartbeat_main
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets
from servers.http.builtin import builtin_app
from servers.http.server import TIMEOUT_LINGER, HttpConfig, serve_http
from servers.tls import TLSOptions

from .conftest import wait_closed
from .test_heartbeat_clients import Server as MqttServer

ROOT = Path(__file__).resolve().parent.parent
needs_mosquitto_clients = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None, reason="mosquitto-clients not installed (apt-get install mosquitto-clients)"
)


@dataclass
class Certs:
    """A CA, the server's certificate (localhost, 127.0.0.1) and two client certificates."""

    dir: Path
    ca: trustme.CA

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    def server(self) -> tuple[str, str]:
        return str(self.dir / "server.pem"), str(self.dir / "server.key")

    def client(self, name: str) -> tuple[str, str]:
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key")

    def client_context(self, name: str | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if name is not None:
            ctx.load_cert_chain(*self.client(name))
        return ctx


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    where = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    server = ca.issue_cert("localhost", "127.0.0.1")
    for blob in server.cert_chain_pems:
        blob.write_to_path(str(where / "server.pem"), append=True)
    server.private_key_pem.write_to_path(str(where / "server.key"))
    for name, cn in (("device-7", "device-7"), ("dashboard", "dashboard"), ("wildcard", "evil+#")):
        leaf = ca.issue_cert(f"{name}.example", common_name=cn)
        for blob in leaf.cert_chain_pems:
            blob.write_to_path(str(where / f"{name}.pem"), append=True)
        leaf.private_key_pem.write_to_path(str(where / f"{name}.key"))
    # A certificate from a CA the server does not trust.
    stranger = trustme.CA().issue_cert("stranger.example", common_name="device-7")
    stranger.cert_chain_pems[0].write_to_path(str(where / "stranger.pem"))
    stranger.private_key_pem.write_to_path(str(where / "stranger.key"))
    return Certs(where, ca)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)  # by PID
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def handshake_cut_after(port: int, timeout: float) -> float:
    """Connect over plain TCP, send half a handshake (nothing useful), and return how long
    the server took to close the connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
    closed = wait_closed(sock, timeout)
    sock.close()
    return closed - start


# -- HTTPS ------------------------------------------------------------------------------


@pytest.fixture(params=["dense", "streams"])
def https_server(certs: Certs, request: pytest.FixtureRequest) -> Iterator[int]:
    cert, key = certs.server()
    port = free_port()
    extra = ["--tls-cert", cert, "--tls-key", key, "--tls-handshake-timeout", "1", "--header-timeout", "1"]
    extra += ["--engine", request.param]
    proc = start_http(port, extra=[*extra, "--keep-alive-timeout", "2", "--tick", "0.05"], cwd=str(ROOT))
    try:
        yield port
    finally:
        stop(proc)


def test_httpx_over_https(https_server: int, certs: Certs) -> None:
    with httpx.Client(base_url=f"https://127.0.0.1:{https_server}", verify=certs.client_context(), timeout=5) as c:
        assert c.get("/").text == "hello from idlekeeper\n"
        assert c.post("/echo", content=b"x" * 200_000).content == b"x" * 200_000
        assert len(c.get("/download?size=3000000").content) == 3_000_000
        metrics = c.get("/metrics").text
    assert 'idlekeeper_tls_handshakes_total{worker="0"}' in metrics
    # Plain HTTP to the HTTPS port gets nowhere.
    with pytest.raises(httpx.HTTPError), httpx.Client(timeout=5) as plain:
        plain.get(f"http://127.0.0.1:{https_server}/")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_over_https_reuses_the_connection(https_server: int, certs: Certs) -> None:
    base = f"https://localhost:{https_server}"
    done = subprocess.run(
        ["curl", "-sv", "--cacert", certs.ca_file, f"{base}/", f"{base}/healthz"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from idlekeeper\nok\n"
    assert "Re-using existing connection" in done.stderr
    assert "SSL connection using TLS" in done.stderr


def test_https_keeps_every_timeout(https_server: int, certs: Certs) -> None:
    # The handshake has its own deadline (1 s here) ...
    assert 1.0 <= handshake_cut_after(https_server, 5) < 1.0 + 0.5
    ctx = certs.client_context()
    # ... after which the header timeout (1 s, from the head's first byte) answers 408 ...
    with socket.create_connection(("127.0.0.1", https_server)) as raw:
        tls = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        start = time.monotonic()
        tls.settimeout(5)
        answer = tls.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert 1.0 <= time.monotonic() - start < 1.5
    # ... and keep-alive (2 s of idleness) closes a quiet connection after its response.
    with socket.create_connection(("127.0.0.1", https_server)) as raw:
        tls = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        tls.settimeout(5)
        assert tls.recv(4096).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        try:
            while tls.recv(4096):
                pass
        except (ssl.SSLError, OSError):
            pass
        assert 2.0 <= time.monotonic() - start < 2.5


def test_http_tls_options_are_checked_at_start(certs: Certs) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "servers.http", "--port", "0", "--tls-cert", certs.server()[0]],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=str(ROOT),
    )
    assert done.returncode == 2
    assert "--tls-cert needs --tls-key" in done.stderr


# -- MQTT over TLS ----------------------------------------------------------------------


@pytest.fixture(params=["dense", "streams"])
def mqtt_server(tmp_path: Path, certs: Certs, request: pytest.FixtureRequest) -> Iterator[object]:
    """Starts MQTT-over-TLS servers, on either engine: the dense engine runs each TLS
    connection from its callbacks (idlekeeper.tls_transport), the streams engine on
    trio's SSLStream, and clients must not tell them apart."""
    started: list[MqttServer] = []
    engine = ["--engine", request.param]

    def start(*args: str) -> MqttServer:
        log = tmp_path / f"presence-{len(started)}.jsonl"
        cert, key = certs.server()
        port = free_port()
        extra = ["--tick", "0.05", "--presence-log", str(log), "--tls-cert", cert, "--tls-key", key, *engine, *args]
        server = MqttServer(start_heartbeat(port, 1, extra, cwd=str(ROOT)), port, log)
        started.append(server)
        return server

    yield start
    for server in started:
        stop(server.proc)


def test_a_certificate_whose_cn_no_username_may_be_is_refused(mqtt_server: object, certs: Certs) -> None:
    # Signed by the trusted CA, so the handshake passes; its CN would take the client's
    # ACL patterns away (a wildcard), so it does not stand for a username: CONNACK 4.
    server: MqttServer = mqtt_server(  # type: ignore[operator]
        "--tls-ca-file", certs.ca_file, "--tls-require-certificate", "--use-identity-as-username"
    )
    refused: list[int] = []
    done = threading.Event()

    def on_connect(c: object, u: object, flags: object, rc: ReasonCode, props: object) -> None:
        refused.append(rc.value)
        done.set()

    client = paho_tls(certs, "wild", "wildcard")
    client.on_connect = on_connect
    client.connect("127.0.0.1", server.port, keepalive=5)
    client.loop_start()
    try:
        assert done.wait(5)
    finally:
        client.loop_stop()
    assert refused == [0x86]  # paho names 3.1.1's CONNACK 4 by MQTT 5's code: bad user name or password
    logged = server.wait_for(lambda e: e["status"] == "refused")
    assert logged[0]["claimed_client_id"] == "wild" and logged[0]["detail"] == "bad-credentials"


@needs_mosquitto_clients
def test_mosquitto_clients_over_tls_presence_as_over_tcp(mqtt_server: object, certs: Certs) -> None:
    server: MqttServer = mqtt_server()  # type: ignore[operator]
    tls = ["--cafile", certs.ca_file, "-h", "localhost", "-p", str(server.port)]
    sub = subprocess.Popen(
        ["mosquitto_sub", *tls, "-t", f"{PRESENCE}#", "-v", "-R", "-C", "2", "-W", "15"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.wait_for(lambda e: e["status"] == "online")  # the subscriber is in
        time.sleep(0.3)
        done = subprocess.run(
            ["mosquitto_pub", *tls, "-i", "tls-dev", "-t", "t", "-m", "hi"], capture_output=True, timeout=10
        )
        assert done.returncode == 0, done.stderr
        out, _ = sub.communicate(timeout=15)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"{PRESENCE}tls-dev ") and '"status":"online"' in lines[0]
    assert lines[1].startswith(f"{PRESENCE}tls-dev ") and '"reason":"disconnect"' in lines[1]


def test_keepalive_and_handshake_deadlines_over_tls(mqtt_server: object, certs: Certs) -> None:
    server: MqttServer = mqtt_server("--tls-handshake-timeout", "1")  # type: ignore[operator]
    # A device that connects over TLS and goes silent is declared dead after 1.5 x keep-alive.
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        tls = certs.client_context().wrap_socket(raw, server_hostname="localhost")
        tls.sendall(encoders.encode_connect("tls-silent", keep_alive=1))
        tls.settimeout(5)
        assert tls.recv(4) == encoders.encode_connack(False, 0)
        start = time.monotonic()
        try:
            while tls.recv(4096):
                pass
        except (ssl.SSLError, OSError):
            pass
        assert 1.5 <= time.monotonic() - start < 1.5 + 0.5
    (event,) = server.wait_for(lambda e: e["client_id"] == "tls-silent" and e["status"] == "offline")
    assert event["reason"] == "keepalive-timeout"
    assert 1.5 <= float(str(event["silent_for"])) < 1.5 + 0.05 + 0.05
    # A client that stalls mid-handshake is cut at the handshake deadline.
    assert 1.0 <= handshake_cut_after(server.port, 5) < 1.0 + 0.5


def tls_v5(port: int, certs: Certs, client_id: str, keep_alive: int) -> ssl.SSLSocket:
    """A raw MQTT 5.0 client over TLS, past its CONNACK."""
    raw = socket.create_connection(("127.0.0.1", port))
    tls = certs.client_context().wrap_socket(raw, server_hostname="localhost")
    tls.settimeout(5)
    tls.sendall(v5_codec.pack(v5_packets.Connect(client_id, keep_alive)))
    connack = tls.recv(4096)
    assert connack[:1] == b"\x20" and connack[3] == 0, connack  # accepted
    return tls


def read_until_closed(tls: ssl.SSLSocket) -> list[v5_packets.Packet]:
    data = b""
    try:
        while chunk := tls.recv(4096):
            data += chunk
    except (ssl.SSLError, OSError):
        pass
    return v5_codec.read_packets(data)


def test_5_0_clients_over_tls_are_told_why_their_connection_ends(mqtt_server: object, certs: Certs) -> None:
    """A keep-alive timeout (0x8D) and a takeover (0x8E) are said in a TLS record: on the
    dense engine the transport seals the reaper's goodbye; on the streams engine the
    reaper cannot make a record, and the connection's task says it, then closes."""
    server: MqttServer = mqtt_server()  # type: ignore[operator]
    silent = tls_v5(server.port, certs, "tls5-silent", keep_alive=1)
    start = time.monotonic()
    assert read_until_closed(silent) == [v5_packets.Disconnect(0x8D)]
    assert 1.5 <= time.monotonic() - start < 1.5 + 0.6
    (event,) = server.wait_for(lambda e: e["client_id"] == "tls5-silent" and e["status"] == "offline")
    assert event["reason"] == "keepalive-timeout" and event["reason_code"] == 0x8D
    old = tls_v5(server.port, certs, "tls5-roamer", keep_alive=30)
    new = tls_v5(server.port, certs, "tls5-roamer", keep_alive=30)
    assert read_until_closed(old) == [v5_packets.Disconnect(0x8E)]  # session taken over
    new.sendall(b"\xc0\x00")  # PINGREQ: the new connection lives
    assert new.recv(2) == b"\xd0\x00"
    new.close()


def test_paho_over_wss_beside_mqtts(mqtt_server: object, certs: Certs) -> None:
    """With TLS options, the WebSocket port is wss: paho-mqtt over TLS WebSockets and a
    TLS MQTT client on the same server hear each other."""
    ws_port = free_port()
    server: MqttServer = mqtt_server("--ws-port", str(ws_port))  # type: ignore[operator]
    got: list[bytes] = []
    heard = threading.Event()
    tcp = paho_tls(certs, "mqtts-watcher", None)

    def on_message(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        got.append(bytes(message.payload))
        heard.set()

    tcp.on_message = on_message
    tcp.on_connect = lambda c, u, f, rc, p: c.subscribe("wss/#", qos=1)
    tcp.connect("localhost", server.port, keepalive=30)
    tcp.loop_start()
    browser = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="wss-browser", transport="websockets")
    browser.ws_set_options(path="/mqtt")
    browser.tls_set(ca_certs=certs.ca_file)
    try:
        server.wait_for(lambda e: e.get("client_id") == "mqtts-watcher" and e["status"] == "online")
        time.sleep(0.3)
        browser.connect("localhost", ws_port, keepalive=30)
        browser.loop_start()
        browser.publish("wss/hello", b"over TLS WebSockets", qos=1).wait_for_publish(5)
        assert heard.wait(5)
    finally:
        browser.loop_stop()
        tcp.loop_stop()
    assert got == [b"over TLS WebSockets"]
    (online,) = server.wait_for(lambda e: e.get("client_id") == "wss-browser" and e["status"] == "online")
    assert online["protocol_level"] == 4


def paho_tls(certs: Certs, client_id: str, name: str | None) -> mqtt.Client:
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
    if name is None:
        client.tls_set(ca_certs=certs.ca_file)
    else:
        cert, key = certs.client(name)
        client.tls_set(ca_certs=certs.ca_file, certfile=cert, keyfile=key)
    return client


def test_client_certificate_cn_is_the_username(mqtt_server: object, certs: Certs, tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    # device-7 may publish only under its own name (%u: the certificate's CN), the
    # dashboard may read everything.
    acl.write_text("user dashboard\ntopic read #\npattern write data/%u/#\n")
    server: MqttServer = mqtt_server(  # type: ignore[operator]
        "--tls-ca-file",
        certs.ca_file,
        "--tls-require-certificate",
        "--use-identity-as-username",
        "--acl-file",
        str(acl),
    )
    got: list[tuple[str, bytes]] = []
    subscribed = threading.Event()
    dashboard = paho_tls(certs, "dash", "dashboard")
    dashboard.on_message = lambda c, u, msg: got.append((msg.topic, bytes(msg.payload)))
    dashboard.on_subscribe = lambda *a: subscribed.set()
    dashboard.connect("127.0.0.1", server.port, keepalive=5)
    dashboard.loop_start()
    try:
        dashboard.subscribe("data/#", qos=1)
        assert subscribed.wait(5)
        device = paho_tls(certs, "dev-7", "device-7")
        device.username_pw_set("someone-else", "whatever")  # ignored: the certificate names the client
        connected = threading.Event()
        device.on_connect = lambda c, u, flags, rc, props: connected.set() if not rc.is_failure else None
        device.connect("127.0.0.1", server.port, keepalive=5)
        device.loop_start()
        assert connected.wait(5)
        device.publish("data/device-8/t", b"forged", qos=1).wait_for_publish(5)
        device.publish("data/device-7/t", b"mine", qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        device.disconnect()
        device.loop_stop()
    finally:
        dashboard.disconnect()
        dashboard.loop_stop()
    assert got == [("data/device-7/t", b"mine")]
    online = server.wait_for(lambda e: e["client_id"] == "dev-7" and e["status"] == "online")
    assert online[0]["username"] == "device-7"
    offline = server.wait_for(lambda e: e["client_id"] == "dev-7" and e["status"] == "offline")
    assert offline[0]["username"] == "device-7" and offline[0]["reason"] == "disconnect"


@needs_mosquitto_clients
def test_missing_or_untrusted_client_certificate_is_refused_at_the_handshake(mqtt_server: object, certs: Certs) -> None:
    server: MqttServer = mqtt_server(  # type: ignore[operator]
        "--tls-ca-file", certs.ca_file, "--tls-require-certificate", "--use-identity-as-username"
    )
    base = ["mosquitto_pub", "--cafile", certs.ca_file, "-h", "localhost", "-p", str(server.port), "-t", "t", "-m", "x"]
    ok = subprocess.run(
        [*base, "--cert", certs.client("device-7")[0], "--key", certs.client("device-7")[1]],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert ok.returncode == 0, ok.stderr
    bare = subprocess.run(base, capture_output=True, text=True, timeout=10)
    assert bare.returncode != 0
    stranger = [*base, "--cert", str(certs.dir / "stranger.pem"), "--key", str(certs.dir / "stranger.key")]
    refused = subprocess.run(stranger, capture_output=True, text=True, timeout=10)
    assert refused.returncode != 0
    # paho without a certificate: refused at the handshake (TLS 1.2) or right after it
    # (TLS 1.3 sends the refusal after the client's Finished): never a CONNACK.
    client = paho_tls(certs, "paho-bare", None)
    connected = threading.Event()
    client.on_connect = lambda c, u, flags, rc, props: connected.set()
    try:
        client.connect("127.0.0.1", server.port, keepalive=5)
        client.loop_start()
        assert not connected.wait(2)
    except (ssl.SSLError, OSError):
        pass
    finally:
        client.loop_stop()
    online = [e for e in server.events() if e["status"] == "online"]
    assert len(online) == 1 and online[0]["username"] == "device-7"  # mosquitto_pub with its certificate


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_tls_keeps_the_engine_asked_for(caplog: pytest.LogCaptureFixture, certs: Certs, engine: str) -> None:
    cert, key = certs.server()
    with caplog.at_level(logging.WARNING, logger="servers.heartbeat"):
        config = HeartbeatConfig(tls=TLSOptions(cert, key), engine=engine)
    assert config.engine == engine
    assert caplog.text == ""


def test_mqtt_tls_options_are_checked_at_start(certs: Certs, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = certs.server()
    with pytest.raises(SystemExit) as exited:
        heartbeat_main(["--port", "0", "--tls-cert", cert, "--tls-key", key, "--use-identity-as-username"])
    assert exited.value.code == 2
    assert "--use-identity-as-username needs --tls-require-certificate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        heartbeat_main(["--port", "0", "--tls-cert", cert, "--tls-key", key, "--tls-require-certificate"])
    assert "needs --tls-ca-file" in capsys.readouterr().err


async def test_https_408_under_mock_clock_without_a_traceback(
    certs: Certs, clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """In process, on mock time: over TLS the header timeout answers 408 exactly on time,
    and the lingering close after it (TLS has no half-close) logs no error."""
    cert, key = certs.server()
    config = HttpConfig(port=0, header_timeout=3.0, tick=0.05, tls=TLSOptions(cert, key))
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_http, builtin_app(lambda: b""), config))
        raw = await trio.open_tcp_stream("127.0.0.1", server.port)
        client = trio.SSLStream(raw, certs.client_context(), server_hostname="localhost")
        await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        sent = trio.current_time()
        reply = b""
        with trio.fail_after(60):
            try:
                while chunk := await client.receive_some():
                    reply += chunk
            except trio.BrokenResourceError:
                pass
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert 3.0 <= trio.current_time() - sent <= 3.0 + 0.05 + TIMEOUT_LINGER
        nursery.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
