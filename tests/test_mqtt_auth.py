"""The password file: salted hashes, constant-time checks, the cache and the CLI;
Mosquitto's formats from the real ``mosquitto_passwd``, checked by our server (and by
Mosquitto, on the same file) with paho and ``mosquitto_pub``; a flood of wrong
passwords against the server as its own process."""

from __future__ import annotations

import base64
import collections
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from prometheus_client.parser import text_string_to_metric_families

from loadtest.mqtt_targets import mosquitto_binary, start_mosquitto
from loadtest.processes import free_port
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.security import passwords
from servers.heartbeat.security.passwords import AuthFileError, AuthResult, PasswordFile
from servers.heartbeat.server.authenticator import Authenticator

from .test_heartbeat_clients import IN_CI, Server, start_server

__all__ = ["start_server"]  # the fixture, used here by name

ROOT = Path(__file__).resolve().parent.parent
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")
needs_mosquitto_passwd = pytest.mark.skipif(
    MOSQUITTO_PASSWD is None and not IN_CI, reason="mosquitto_passwd not installed (apt-get install mosquitto)"
)


def test_check_outcomes() -> None:
    users = PasswordFile()
    users.set("alice", b"wonder", iterations=1000)
    assert users.check("alice", b"wonder") is AuthResult.ACCEPTED
    assert users.check("alice", b"wrong") is AuthResult.BAD_CREDENTIALS
    assert users.check("bob", b"wonder") is AuthResult.BAD_CREDENTIALS
    assert users.check("alice", None) is AuthResult.BAD_CREDENTIALS
    assert users.check(None, None) is AuthResult.NOT_AUTHORIZED
    assert "alice" in users and len(users) == 1


def test_hashes_are_salted_and_never_plain() -> None:
    one, two = passwords.hash_password(b"secret", iterations=1000), passwords.hash_password(b"secret", iterations=1000)
    assert one != two
    assert "secret" not in one
    assert one.startswith("pbkdf2_sha256$1000$")


def test_the_default_cost_is_owasps() -> None:
    # OWASP's Password Storage Cheat Sheet (2023): PBKDF2-HMAC-SHA256, 600,000 rounds.
    assert passwords.DEFAULT_ITERATIONS >= 600_000
    assert passwords.hash_password(b"secret").startswith("pbkdf2_sha256$600000$")
    users = PasswordFile()
    users.set("u", b"p")
    assert PasswordFile.from_lines([f"u:{users._users['u'].line()}"])._users["u"].cost() == (passwords.SCHEME, 600_000)


def test_file_round_trip_and_mode(tmp_path: Path) -> None:
    users = PasswordFile()
    users.set("a", b"1", iterations=1000)
    users.set("b:c".replace(":", "-"), b"2", iterations=1000)
    target = tmp_path / "users"
    users.save(target)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    again = PasswordFile.load(target)
    assert again.check("a", b"1") is AuthResult.ACCEPTED
    assert again.check("b-c", b"2") is AuthResult.ACCEPTED


@pytest.mark.parametrize(
    "line",
    [
        "no-colon-here",
        "u:md5$1$abc$def",
        "u:pbkdf2_sha256$many$abc$def",
        "u:pbkdf2_sha256$10$!!!$def",
        "u:pbkdf2_sha256$10$abc",
        "u:pbkdf2_sha256$0$abc$def",
        "u:$7$101$6hkha2fYqtVeIYEl$lJan3jhDRLGusbm8tFtkCFgs1eo1RWcrmnAjqZnCYUYd",  # a 48-byte hash
        "u:$7$0$6hkha2fYqtVeIYEl$" + "A" * 86 + "==",  # no rounds
        "u:$7$101$6hkha2fY$" + "A" * 86 + "==",  # a 6-byte salt
        "u:$7$101$6hkha2fYqtVeIYE!$" + "A" * 86 + "==",  # not base64
        "u:$6$r6BIDsSrg9xHTWgS$CLR8jZn6JNebzcNGyIiuDucZ",
        "u:$6$r6BIDsSrg9xHTWgS",
        "u:$5$abc$def",
    ],
)
def test_malformed_lines_name_the_line(line: str) -> None:
    with pytest.raises(AuthFileError, match=r"users:3"):
        PasswordFile.from_lines(["# comment", "", line], source="users")


def test_argon2id_lines_say_what_to_do() -> None:
    line = "u:$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo"
    with pytest.raises(AuthFileError, match=r"users:1: .*argon2id .*mosquitto_passwd -H sha512-pbkdf2"):
        PasswordFile.from_lines([line], source="users")


def test_cache_skips_pbkdf2_and_forgets_changed_users(monkeypatch: pytest.MonkeyPatch) -> None:
    users = PasswordFile()
    users.set("dev", b"pw", iterations=1000)
    calls = 0
    real = hashlib.pbkdf2_hmac

    def counting(*args: object, **kw: object) -> bytes:
        nonlocal calls
        calls += 1
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", counting)
    assert users.check("dev", b"pw") is AuthResult.ACCEPTED
    assert users.check("dev", b"pw") is AuthResult.ACCEPTED
    assert calls == 1
    assert users.check("dev", b"other") is AuthResult.BAD_CREDENTIALS  # not cached: computed
    assert calls == 2 and users.cached("dev", b"pw") and not users.cached("dev", b"other")
    users.set("dev", b"new", iterations=1000)
    assert not users.cached("dev", b"pw")
    assert users.check("dev", b"pw") is AuthResult.BAD_CREDENTIALS


def test_the_cache_holds_one_keyed_digest_per_user() -> None:
    users = PasswordFile()
    users.set("dev", b"pw", iterations=1000)
    for _ in range(3):
        assert users.check("dev", b"pw") is AuthResult.ACCEPTED
    for i in range(100):  # wrong passwords and unknown users are never cached
        users.check("dev", f"x{i}".encode())
        users.check(f"nobody-{i}", b"pw")
    assert list(users._cache) == ["dev"]
    _, digest = users._cache["dev"]
    assert digest not in (b"pw", hashlib.sha256(b"pw").digest())  # keyed: no fast hash of the password
    assert not users.cached(None, b"pw") and not users.cached("dev", None)


def test_an_unknown_user_costs_a_hash_like_the_files_own(monkeypatch: pytest.MonkeyPatch) -> None:
    users = PasswordFile()
    for name in ("a", "b"):
        users.set(name, b"pw", iterations=3000)
    users.set("c", b"pw", iterations=2000)
    rounds: list[int] = []
    real = hashlib.pbkdf2_hmac

    def counting(name: str, password: bytes, salt: bytes, iterations: int, *rest: object) -> bytes:
        rounds.append(iterations)
        return real(name, password, salt, iterations)

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", counting)
    assert users.check("nobody", b"pw") is AuthResult.BAD_CREDENTIALS
    assert rounds == [3000]  # the file's most common cost, not a fixed one


def test_cli(tmp_path: Path) -> None:
    target = str(tmp_path / "users")

    def run(*args: str, stdin: str = "") -> int:
        done = subprocess.run(
            [sys.executable, "-m", "servers.heartbeat.auth", *args],
            input=stdin,
            text=True,
            cwd=ROOT,
            capture_output=True,
        )
        return done.returncode

    assert run("add", target, "sensor-1", stdin="hunter2\n") == 0
    assert run("check", target, "sensor-1", stdin="hunter2\n") == 0
    assert run("check", target, "sensor-1", stdin="nope\n") == 1
    assert run("remove", target, "sensor-1") == 0
    assert run("check", target, "sensor-1", stdin="hunter2\n") == 1
    Path(target).write_text("garbage\n")
    assert run("check", target, "x", stdin="y\n") == 2


# -- Mosquitto's password files ---------------------------------------------------------


def mosquitto_passwd(target: Path, user: str, password: str, *args: str) -> None:
    """``mosquitto_passwd -b``, as an operator would run it."""
    assert MOSQUITTO_PASSWD is not None
    subprocess.run([MOSQUITTO_PASSWD, *args, "-b", str(target), user, password], check=True, capture_output=True)


def mixed_file(tmp_path: Path) -> Path:
    """Mosquitto's $7$ and $6$ lines beside ours, in one file."""
    target = tmp_path / "passwd"
    mosquitto_passwd(target, "alice", "wonder", "-c")  # sha512-pbkdf2, $7$: mosquitto_passwd's default
    mosquitto_passwd(target, "carol", "c4r0l", "-H", "sha512")  # $6$, Mosquitto 1.6's
    mosquitto_passwd(target, "dä v", "p:ss wörd")  # a blank and UTF-8 in the name, a colon in the password
    subprocess.run(
        [sys.executable, "-m", "servers.heartbeat.auth", "add", str(target), "ours", "--iterations", "1000"],
        input="mine\n",
        text=True,
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return target


@needs_mosquitto_passwd
def test_files_from_mosquitto_passwd_are_read_beside_ours(tmp_path: Path) -> None:
    target = tmp_path / "passwd"
    mosquitto_passwd(target, "alice", "wonder", "-c")
    mosquitto_passwd(target, "carol", "c4r0l", "-H", "sha512")
    mosquitto_passwd(target, "dä v", "p:ss wörd")
    theirs = {line.split(":", 1)[0]: line for line in target.read_text().splitlines()}
    assert theirs["alice"].startswith("alice:$7$101$") and theirs["carol"].startswith("carol:$6$")
    (tmp_path / "mixed").mkdir()
    mixed = mixed_file(tmp_path / "mixed")  # a second file, with our own user added by our CLI
    users = PasswordFile.load(mixed)
    assert sorted(users._users) == ["alice", "carol", "dä v", "ours"]
    for name, right in (("alice", "wonder"), ("carol", "c4r0l"), ("dä v", "p:ss wörd"), ("ours", "mine")):
        assert users.check(name, right.encode()) is AuthResult.ACCEPTED, name
        assert users.check(name, right.encode() + b"x") is AuthResult.BAD_CREDENTIALS, name
        assert users.check(name, b"") is AuthResult.BAD_CREDENTIALS, name
    # Our CLI rewrote the file: Mosquitto's lines are as mosquitto_passwd wrote them.
    lines = PasswordFile.load(target)
    lines.save(target)
    assert {line.split(":", 1)[0]: line for line in target.read_text().splitlines()} == theirs


def test_mosquitto_formats_by_hand() -> None:
    """Mosquitto 2.1 writes 64-byte salts for $6$; both salt sizes are read for both."""
    password = b"s3cret"
    lines = []
    for i, salt in enumerate((b"s" * 12, b"t" * 64)):
        pbkdf2 = hashlib.pbkdf2_hmac("sha512", password, salt, 7)
        sha = hashlib.sha512(password + salt).digest()
        b64 = base64.b64encode
        lines.append(f"p{i}:$7$7${b64(salt).decode()}${b64(pbkdf2).decode()}")
        lines.append(f"  s{i} :$6${b64(salt).decode()}${b64(sha).decode()}  ")  # blanks trimmed, as Mosquitto does
    users = PasswordFile.from_lines(lines)
    for name in ("p0", "s0", "p1", "s1"):
        assert users.check(name, password) is AuthResult.ACCEPTED
        assert users.check(name, b"s3cre") is AuthResult.BAD_CREDENTIALS


def connack(port: int, username: str, password: bytes, source: str = "127.0.0.1") -> int:
    """The CONNACK return code a raw CONNECT from ``source`` gets."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(encoders.encode_connect("raw", keep_alive=0, username=username, password=password))
        got = b""
        while len(got) < 4:
            chunk = sock.recv(4 - len(got))
            assert chunk, "closed without a CONNACK"
            got += chunk
    assert got[:3] == b"\x20\x02\x00"
    return got[3]


def paho_connects(port: int, username: str, password: str, source: str = "") -> tuple[bool, str]:
    """Whether paho gets in, and the reason it was told."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"paho-{username}", protocol=mqtt.MQTTv311)
    client.username_pw_set(username, password)
    done = threading.Event()
    outcome: list[tuple[bool, str]] = []

    def on_connect(c: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
        outcome.append((not reason.is_failure, str(reason)))  # type: ignore[attr-defined]
        done.set()

    client.on_connect = on_connect
    client.connect("127.0.0.1", port, keepalive=30, bind_address=source)
    client.loop_start()
    try:
        assert done.wait(15), "no CONNACK"
    finally:
        client.disconnect()
        client.loop_stop()
    return outcome[0]


def mosquitto_pub(port: int, username: str, password: str, source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *("mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-V", "mqttv311", "-A", source),
            *("-u", username, "-P", password, "-i", "pub", "-t", "t", "-m", "hi"),
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )


@needs_mosquitto_passwd
@pytest.mark.skipif(shutil.which("mosquitto_pub") is None and not IN_CI, reason="mosquitto-clients not installed")
@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_our_server_and_mosquitto_answer_the_same_file_alike(start_server: object, tmp_path: Path, engine: str) -> None:
    target = mixed_file(tmp_path)
    server: Server = start_server("--engine", engine, "--auth-file", str(target))  # type: ignore[operator]
    peers = [("heartbeat", server.port)]
    mosquitto = None
    if mosquitto_binary() is not None:
        # As root, Mosquitto reads the file after dropping to its own user, who may not: stay root.
        stay = "user root\n" if os.geteuid() == 0 else ""
        mosquitto = start_mosquitto("auth", free_port(), f"allow_anonymous false\npassword_file {target}\n{stay}")
    try:
        if mosquitto is not None:
            peers.append(("mosquitto", mosquitto.port))
        for name, port in peers:
            # Each user from an address of its own: a few wrong passwords from one
            # address would have our server delay that address's next checks.
            for i, (user, right) in enumerate((("alice", "wonder"), ("carol", "c4r0l"), ("dä v", "p:ss wörd"))):
                source = f"127.0.0.{10 + i}"
                assert paho_connects(port, user, right, source) == (True, "Success"), (name, user)
                accepted, reason = paho_connects(port, user, right + "!", source)
                assert not accepted and reason in ("Bad user name or password", "Not authorized"), (name, reason)
                assert connack(port, user, (right + "!").encode(), source) in (4, 5), name
            assert mosquitto_pub(port, "alice", "wonder", "127.0.0.20").returncode == 0, name
            wrong = mosquitto_pub(port, "alice", "wander", "127.0.0.20")
            assert wrong.returncode != 0 and "Connection Refused" in wrong.stderr, (name, wrong.stderr)
        # Ours: a wrong password is "bad user name or password" (4); no username, 5.
        assert connack(server.port, "alice", b"nope") == 4
        assert connack(server.port, "ours", b"mine") == 0
    finally:
        if mosquitto is not None:
            mosquitto.stop()


def scrape(server: Server) -> dict[str, float]:
    assert server.status_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("heartbeat_auth")
    }


@needs_mosquitto_passwd
def test_a_flood_of_wrong_passwords_does_not_slow_a_device_elsewhere(start_server: object, tmp_path: Path) -> None:
    """The server as its own process: one address floods wrong passwords as fast as it
    can; a device from another address (127.0.0.2), with its right password, gets in
    while the flood runs; /metrics shows how little of the flood was hashed."""
    target = mixed_file(tmp_path)
    server: Server = start_server("--auth-file", str(target), status=True)  # type: ignore[operator]
    stop = threading.Event()
    answers: list[int] = []

    def flood() -> None:
        deadline = time.monotonic() + 20
        while not stop.is_set() and time.monotonic() < deadline and len(answers) < 5000:
            answers.append(connack(server.port, "alice", f"guess-{len(answers)}".encode()))

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        while len(answers) < 200:  # the flood is well under way, and throttled
            assert flooder.is_alive()
            time.sleep(0.01)
        started = time.monotonic()
        assert paho_connects(server.port, "dä v", "p:ss wörd", source="127.0.0.2") == (True, "Success")
        waited = time.monotonic() - started
        during = len(answers)
        time.sleep(0.2)
    finally:
        stop.set()
        flooder.join(30)
    assert len(answers) > during  # the flood ran on, before and after the device got in
    assert set(answers) == {4}  # every guess told the same, checked or not
    figures = scrape(server)
    # Five guesses were hashed, and perhaps one more per delay that passed; the rest not.
    assert figures["heartbeat_auth_failures_total"] <= 5 + 3
    assert figures["heartbeat_auth_throttled_total"] >= len(answers) - 8
    assert figures["heartbeat_auth_checks_total"] == figures["heartbeat_auth_failures_total"] + 1  # + the device
    assert figures["heartbeat_auth_delayed_sources"] == 1
    assert figures["heartbeat_auth_source_delay_seconds"] > 0
    # Not a timing test: a bound far above one check and far below one throttle delay.
    assert waited < 5.0


@pytest.mark.parametrize(
    ("name", "code"),
    [("device-7", 0), ("org/device-7", 0), (None, 4), ("", 4), ("a+b", 4), ("a#", 4), ("a\x01b", 4), ("x" * 33, 4)],
)
def test_a_certificate_name_stands_for_a_username_only_if_one_could_be_it(
    monkeypatch: pytest.MonkeyPatch, name: str | None, code: int
) -> None:
    # "/" passes (a username may hold one; it only takes the %u patterns away), what
    # would take away every pattern or could not be a username does not.
    authenticator = Authenticator(HeartbeatConfig(max_username=32), collections.Counter())
    monkeypatch.setattr(Authenticator, "username", lambda self, conn, request: name)
    assert authenticator.certified(None, None) == code  # type: ignore[arg-type]
