"""SIGHUP re-reads the password file (issue 61, item 7), as Mosquitto re-reads its
password_file: a user the operator adds with ``mosquitto_passwd`` may connect without
a restart, one removed may not connect again (its open connection stays), and a file
that went wrong (a bad line, gone) keeps the users in force, with one log line saying
which file and line. On the real server, one worker and two (the supervisor passes
SIGHUP on); every process is stopped by its PID.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets
from servers.heartbeat.mqtt.v5.reason_codes import ReasonCode
from servers.heartbeat.security.passwords import AuthFileError, PasswordFile

from .test_presence_faults import until

ROOT = Path(__file__).resolve().parent.parent
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")


def add_user(path: Path, username: str, password: str, *, create: bool = False) -> None:
    """Add ``username`` as an operator would: with mosquitto_passwd, else our own command."""
    if MOSQUITTO_PASSWD is not None:
        command = [MOSQUITTO_PASSWD, "-b", *(["-c"] if create else []), str(path), username, password]
        subprocess.run(command, check=True, capture_output=True, timeout=30)
        return
    command = [sys.executable, "-m", "servers.heartbeat.auth", "add", str(path), username, "--iterations", "1000"]
    subprocess.run(command, input=password + "\n", text=True, check=True, capture_output=True, timeout=30, cwd=ROOT)


def remove_user(path: Path, username: str) -> None:
    """Remove ``username`` with mosquitto_passwd, else our own command."""
    if MOSQUITTO_PASSWD is not None:
        command = [MOSQUITTO_PASSWD, "-D", str(path), username]
    else:
        command = [sys.executable, "-m", "servers.heartbeat.auth", "remove", str(path), username]
    subprocess.run(command, check=True, capture_output=True, timeout=30, cwd=ROOT)


def connect(port: int, client_id: str, username: str, password: str, *, v5: bool = False) -> tuple[int, socket.socket]:
    """A CONNECT with these credentials: its CONNACK's code, and the socket (open if accepted)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    secret = password.encode()
    if v5:
        sock.sendall(v5_codec.pack(v5_packets.Connect(client_id, 60, username=username, password=secret)))
    else:
        sock.sendall(encoders.encode_connect(client_id, keep_alive=60, username=username, password=secret))
    head = sock.recv(2)
    assert head[:1] == b"\x20" and head[1] < 0x80, head  # a CONNACK, short
    body = b""
    while len(body) < head[1]:
        body += sock.recv(head[1] - len(body))
    return body[1], sock


def accepted(port: int, client_id: str, username: str, password: str) -> bool:
    code, sock = connect(port, client_id, username, password)
    sock.close()
    return code == 0


def log_lines(log: Path, text: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if text in line] if log.exists() else []


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """Starts ``python -m servers.heartbeat`` with the given workers and arguments; its
    stderr goes to ``tmp_path / "stderr.log"``. Stopped by its PID."""
    started: list[subprocess.Popen[str]] = []

    def start(workers: int, *args: str) -> tuple[subprocess.Popen[str], int, Path]:
        port, log = free_port(), tmp_path / "stderr.log"
        started.append(start_heartbeat(port, workers, ["--tick", "0.05", *args], cwd=str(ROOT), log=log))
        return started[-1], port, log

    yield start
    for proc in started:
        stop(proc)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_operator_adds_a_user_with_mosquitto_passwd_and_sighup_lets_it_in_a_broken_file_changes_nobody(
    serve: object, tmp_path: Path, workers: int
) -> None:
    users = tmp_path / "passwords"
    add_user(users, "alice", "alice-pw", create=True)
    # Failures are not throttled here: the refusals below must be the file's, not the throttle's.
    proc, port, log = serve(workers, "--auth-file", str(users), "--auth-free-failures", "100")  # type: ignore[operator]
    code, alice = connect(port, "alice-1", "alice", "alice-pw")
    assert code == 0

    # Added after start: refused (as a wrong password is) until the file is reloaded.
    add_user(users, "bob", "bob-pw")
    remove_user(users, "alice")
    assert connect(port, "bob-1", "bob", "bob-pw")[0] == 4
    assert connect(port, "bob-1", "bob", "bob-pw", v5=True)[0] == ReasonCode.BAD_USER_NAME_OR_PASSWORD
    proc.send_signal(signal.SIGHUP)  # by PID; the supervisor passes it on to its workers
    until(lambda: len(log_lines(log, "password file reloaded")) == workers, 10, "every worker's reload")
    for i in range(4):  # the connections land on either worker
        assert accepted(port, f"bob-{i}", "bob", "bob-pw")
        assert not accepted(port, f"alice-{i + 2}", "alice", "alice-pw")
    alice.sendall(encoders.encode_pingreq())  # authenticated before the reload: it stays
    assert alice.recv(2) == encoders.encode_pingresp()

    # A bad line: the users in force stay, and each worker says why in one line.
    good = users.read_text()
    bad_line = len(good.splitlines()) + 1
    users.write_text(good + "carol-without-a-hash\n")
    proc.send_signal(signal.SIGHUP)
    until(lambda: len(log_lines(log, "password file not reloaded")) == workers, 10, "the refusals")
    refusals = log_lines(log, "password file not reloaded")
    assert all(f"{users}:{bad_line}" in line for line in refusals), refusals
    for i in range(4):
        assert accepted(port, f"bob-bad-{i}", "bob", "bob-pw")

    # The file gone: the same.
    users.unlink()
    proc.send_signal(signal.SIGHUP)
    until(lambda: len(log_lines(log, "password file not reloaded")) == 2 * workers, 10, "the refusals")
    gone = log_lines(log, "password file not reloaded")[workers:]
    assert all(f"{users}: cannot read" in line for line in gone), gone
    for i in range(4):
        assert accepted(port, f"bob-gone-{i}", "bob", "bob-pw")
    time.sleep(0.2)
    text = log.read_text()
    assert "Traceback" not in text, text
    assert len(log_lines(log, "password file reloaded")) == workers  # no other reload happened
    alice.sendall(encoders.encode_pingreq())
    assert alice.recv(2) == encoders.encode_pingresp()
    alice.close()
    assert proc.poll() is None


# -- the file's own reload -----------------------------------------------------------------


def test_a_reload_keeps_what_unchanged_users_proved_and_forgets_the_rest(tmp_path: Path) -> None:
    users = tmp_path / "passwords"
    add_user(users, "alice", "alice-pw", create=True)
    add_user(users, "bob", "bob-pw")
    passwords = PasswordFile.load(users)
    assert passwords.check("alice", b"alice-pw") == 0 and passwords.check("bob", b"bob-pw") == 0
    add_user(users, "bob", "new-bob-pw")  # changed
    add_user(users, "carol", "carol-pw")  # added
    assert passwords.reload() == 3
    assert passwords.cached("alice", b"alice-pw")  # unchanged: no hashing at the next CONNECT
    assert not passwords.cached("bob", b"bob-pw")
    assert passwords.check("bob", b"bob-pw") != 0 and passwords.check("bob", b"new-bob-pw") == 0
    assert passwords.check("carol", b"carol-pw") == 0


def test_a_reload_of_a_broken_or_missing_file_keeps_the_users_and_names_the_file_and_line(tmp_path: Path) -> None:
    users = tmp_path / "passwords"
    add_user(users, "alice", "alice-pw", create=True)
    passwords = PasswordFile.load(users)
    users.write_text(users.read_text() + "\n# fine\nbroken\n")
    with pytest.raises(AuthFileError, match=f"^{users}:4: "):
        passwords.reload()
    users.write_bytes(users.read_bytes().replace(b"broken", b"caf\xe9:x"))
    with pytest.raises(AuthFileError, match=f"^{users}:4: not UTF-8"):
        passwords.reload()
    users.unlink()
    with pytest.raises(AuthFileError, match=f"^{users}: cannot read"):
        passwords.reload()
    assert passwords.check("alice", b"alice-pw") == 0
