"""``-c FILE`` on real Mosquitto files (issue 63): Debian's packaged
``/etc/mosquitto/mosquitto.conf`` with its ``include_dir``, the fully commented example
the package ships with each of its directives uncommented in turn, and the real server
started on Debian's file, a client connecting to it.

The files come with Debian's ``mosquitto`` package (``.ci/run`` installs it); without
it these tests are skipped, saying so."""

from __future__ import annotations

import gzip
import re
import signal
import socket
from pathlib import Path

import pytest

from loadtest.processes import free_port, start_heartbeat
from servers.conffile import ConfigError
from servers.heartbeat.conf import PERSISTENCE_FILE, translate
from servers.heartbeat.mqtt import encoders

from .test_heartbeat_clients import ROOT, raw_connect

DEBIAN = Path("/etc/mosquitto/mosquitto.conf")
EXAMPLES = Path("/usr/share/doc/mosquitto/examples")

needs_debian = pytest.mark.skipif(
    not DEBIAN.is_file(), reason="Debian's mosquitto package is not installed (apt-get install mosquitto)"
)

# The paths of Debian's file that this test box may not write (or a test must not):
# the command line replaces them, as an operator trying the server out would.
OVERRIDES = frozenset({"--persistence", "--log-file", "--pid-file"})


def example_text() -> str:
    plain, packed = EXAMPLES / "mosquitto.conf", EXAMPLES / "mosquitto.conf.gz"
    if plain.is_file():
        return plain.read_text()
    if packed.is_file():
        return gzip.decompress(packed.read_bytes()).decode()
    pytest.skip("Mosquitto's example mosquitto.conf is not installed (Debian's mosquitto package)")


@needs_debian
def test_debians_packaged_file_translates(tmp_path: Path) -> None:
    arguments, warnings = translate(str(DEBIAN), OVERRIDES)
    assert warnings == []
    assert arguments == []  # all it says is about the three paths the command line replaces
    # Its own paths, under a test directory: the whole translation.
    copy = tmp_path / "mosquitto.conf"
    text = DEBIAN.read_text()
    for old in ("/run/mosquitto/", "/var/lib/mosquitto/", "/var/log/mosquitto/"):
        text = text.replace(old, f"{tmp_path}/")
    copy.write_text(text)
    arguments, warnings = translate(str(copy))
    assert arguments == [
        "--pid-file", f"{tmp_path}/mosquitto.pid",
        "--persistence", f"{tmp_path}/{PERSISTENCE_FILE}",  # never Mosquitto's own mosquitto.db
        "--log-file", f"{tmp_path}/mosquitto.log",
    ]  # fmt: skip
    assert "include_dir /etc/mosquitto/conf.d" in text  # read too: only a README there


def test_the_commented_example_is_all_comments(tmp_path: Path) -> None:
    copy = tmp_path / "example.conf"
    copy.write_text(example_text())
    assert translate(str(copy)) == ([], [])


def example_directives() -> list[str]:
    """Each line of the example that is a directive commented out (``#name value``)."""
    try:
        text = example_text()
    except pytest.skip.Exception:
        return []
    return sorted({line[1:].strip() for line in text.splitlines() if re.match(r"#[a-z][a-z0-9_.]*( |$)", line)})


@pytest.mark.parametrize("section", ["global", "listener"])
def test_each_directive_of_the_example_is_supported_refused_or_warned(tmp_path: Path, section: str) -> None:
    lines = example_directives()
    if not lines:
        pytest.skip("Mosquitto's example mosquitto.conf is not installed (Debian's mosquitto package)")
    outcomes: dict[str, list[str]] = {"supported": [], "warned": [], "refused": []}
    for n, line in enumerate(lines):
        path = tmp_path / f"{n}.conf"
        head = "listener 1883 127.0.0.1\n" if section == "listener" else ""
        path.write_text(f"# {line!r} uncommented\n{head}{line}\n")
        at = 3 if head else 2
        try:
            _, warnings = translate(str(path), OVERRIDES)
        except ConfigError as exc:
            message = str(exc)
            name = line.split()[0]
            assert "\n" not in message
            assert message.startswith((f"{path}:{at}: {name}: ", f"{path}:2: listener: ")), message
            assert "unknown directive" not in message, message  # every directive of Mosquitto's is known
            outcomes["refused"].append(line)
            continue
        (outcomes["warned"] if warnings else outcomes["supported"]).append(line)
        for warning in warnings:
            assert warning.startswith(f"{path}:"), warning
    # About a third of the example's directives (its own values) are honoured as they are.
    assert len(outcomes["supported"]) >= 20, outcomes
    assert outcomes["warned"], outcomes
    assert any("connection" in line for line in outcomes["refused"]), outcomes


@needs_debian
def test_the_server_runs_on_debians_file(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    extra = [
        "-c", str(DEBIAN),
        "--persistence", str(tmp_path / "state.db"),
        "--log-file", str(log),
        "--pid-file", str(tmp_path / "server.pid"),
        "--connection-messages", "--log-level", "INFO",
    ]  # fmt: skip
    proc = start_heartbeat(port, 1, extra, cwd=str(ROOT), log=tmp_path / "stderr.log")
    try:
        sock = raw_connect(port, "meter-1", 60, username="alice")
        sock.sendall(encoders.encode_disconnect())
        sock.settimeout(5)
        assert sock.recv(1) == b""  # the server closes after DISCONNECT
        sock.close()
        # Anonymous clients are let in: Debian's file has no listener (local only, as Mosquitto).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as other:
            other.sendall(encoders.encode_connect("meter-2", keep_alive=30))
            assert other.recv(4) == encoders.encode_connack(False, 0)
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert re.search(r"New client connected from 127\.0\.0\.1:\d+ as meter-1 \(p2, c1, k60, u'alice'\)\.", text), text
    assert "Client meter-1 disconnected." in text, text
    assert (tmp_path / "state.db").exists()
    assert "Traceback" not in (tmp_path / "stderr.log").read_text()


def test_the_supervisor_warns_once_and_its_workers_read_the_file_again(tmp_path: Path) -> None:
    conf = tmp_path / "mosquitto.conf"
    conf.write_text("user mosquitto\nmax_keepalive 60\n")
    port = free_port()
    stderr = tmp_path / "stderr.log"
    proc = start_heartbeat(port, 2, ["-c", str(conf)], cwd=str(ROOT), log=stderr)
    try:
        raw_connect(port, "meter-3", 30).close()
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=60) == 0
    text = stderr.read_text()
    assert text.count("user: ignored: this server does not drop privileges") == 1, text
