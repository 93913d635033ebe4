"""Running as a service (issue 63): systemd's ``sd_notify`` protocol (servers.systemd),
``--pid-file``, the console scripts, and the unit files shipped in contrib/systemd.

A datagram socket bound by the test stands in for systemd: the server is started with
``NOTIFY_SOCKET`` naming it, as systemd starts a ``Type=notify`` service.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.processes import free_port
from servers.readiness import find_ready
from servers.systemd import WORKER_NOTIFY_FD_ENV, Notifier, WorkerGate, parse_message, worker_environ
from servers.workers import module_command

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("idlekeeper-heartbeat", "idlekeeper-http", "idlekeeper-passwd", "idlekeeper-loadtest")

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets, PR_SET_PDEATHSIG")


class FakeSystemd:
    """The notification socket: a bound AF_UNIX datagram socket, and what came on it."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        """The NOTIFY_SOCKET value: a path, or ``@name``."""
        self.heard: list[dict[str, str]] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "NOTIFY_SOCKET": self.name, **extra}

    def next(self, timeout: float = 20.0) -> dict[str, str]:
        self.sock.settimeout(timeout)
        fields = parse_message(self.sock.recv(4096))
        self.heard.append(fields)
        return fields

    def until(self, name: str, timeout: float = 20.0) -> dict[str, str]:
        """The next datagram that sets ``name`` (others are kept in :attr:`heard`)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.next(max(0.01, deadline - time.monotonic()))
            if name in fields:
                return fields


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A socket's path must fit in 108 bytes: pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="ik-sd-") as where:
        yield Path(where)


@pytest.fixture
def systemd(short_dir: Path) -> Iterator[FakeSystemd]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = short_dir / "notify"
    sock.bind(str(path))
    try:
        yield FakeSystemd(sock, str(path))
    finally:
        sock.close()


@pytest.fixture
def abstract_systemd() -> Iterator[FakeSystemd]:
    if not sys.platform.startswith("linux"):
        pytest.skip("abstract sockets are Linux's")
    name = f"idlekeeper-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        yield FakeSystemd(sock, "@" + name)
    finally:
        sock.close()


# --- the Notifier, alone ---------------------------------------------------------


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert not notifier.ready("serving")
    assert notifier.watchdog_interval is None


def test_ready_names_the_pid_and_status_on_a_path_socket(systemd: FakeSystemd) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": systemd.name})
    assert notifier.ready("listening on 127.0.0.1:1883\nand more")
    fields = systemd.next(5)
    assert fields == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "listening on 127.0.0.1:1883 and more"}
    assert notifier.stopping()
    assert systemd.next(5) == {"STOPPING": "1"}
    notifier.close()


def test_an_abstract_socket_is_reached_by_its_at_name(abstract_systemd: FakeSystemd) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": abstract_systemd.name})
    before = time.monotonic_ns() // 1000
    assert notifier.reloading()
    fields = abstract_systemd.next(5)
    after = time.monotonic_ns() // 1000
    assert fields["RELOADING"] == "1"
    # Type=notify-reload compares it with CLOCK_MONOTONIC: Python's monotonic clock is it.
    assert before <= int(fields["MONOTONIC_USEC"]) <= after
    assert notifier.watchdog()
    assert abstract_systemd.next(5) == {"WATCHDOG": "1"}
    notifier.close()


def test_the_variables_are_taken_out_for_the_processes_it_starts(systemd: FakeSystemd) -> None:
    env = {"NOTIFY_SOCKET": systemd.name, "WATCHDOG_USEC": "3000000", "PATH": "/bin"}
    notifier = Notifier.from_environ(env, unset=True)
    assert notifier.enabled and notifier.watchdog_interval == 1.5
    assert env == {"PATH": "/bin"}


@pytest.mark.parametrize(("pid", "interval"), [(None, 0.25), ("ours", 0.25), ("1", None)])
def test_the_watchdog_pings_at_half_its_timeout_if_it_watches_this_process(
    systemd: FakeSystemd, pid: str | None, interval: float | None
) -> None:
    env = {"NOTIFY_SOCKET": systemd.name, "WATCHDOG_USEC": "500000"}
    if pid is not None:
        env["WATCHDOG_PID"] = str(os.getpid()) if pid == "ours" else pid
    assert Notifier.from_environ(env).watchdog_interval == interval


def test_a_socket_nobody_listens_on_is_logged_once_and_never_raised(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(short_dir / "nobody")})
    with caplog.at_level(logging.WARNING, logger="servers.systemd"):
        assert not notifier.ready()
        assert not notifier.watchdog()
        assert not notifier.stopping()
    assert len(caplog.records) == 1 and "cannot notify" in caplog.records[0].getMessage()


def test_an_address_it_cannot_reach_turns_it_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="servers.systemd"):
        assert not Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert "not a Unix socket" in caplog.text


def test_a_worker_speaks_to_its_supervisor_never_to_systemd(systemd: FakeSystemd) -> None:
    assert not Notifier.from_environ({"NOTIFY_SOCKET": systemd.name}, worker=True).enabled
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours:
        env = worker_environ({"NOTIFY_SOCKET": systemd.name, "WATCHDOG_USEC": "1", "HOME": "/h"}, theirs.fileno())
        assert env == {"HOME": "/h", WORKER_NOTIFY_FD_ENV: str(theirs.fileno())}
        worker = Notifier.from_environ(env, worker=True)  # takes the descriptor over
        assert worker.ready("w0")
        assert parse_message(ours.recv(4096)) == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "w0"}
        worker.close()


# --- the supervisor's gate ------------------------------------------------------------


def _ready(pid: int, status: str = "") -> bytes:
    return f"READY=1\nMAINPID={pid}\nSTATUS={status}\n".encode()


def test_the_gate_says_ready_once_every_worker_has(systemd: FakeSystemd) -> None:
    gate = WorkerGate(Notifier(systemd.name), describe=lambda statuses: " | ".join(sorted(statuses)))
    gate.heard(_ready(11, "w0"))
    assert not gate.check([11, 12], 2)
    gate.heard(b"STOPPING=1\nMAINPID=12\n")  # not readiness
    assert not gate.check([11, 12], 2)
    assert not gate.check([11], 2)  # worker 1 died and is not back yet
    gate.heard(_ready(12, "w1"))
    assert gate.check([11, 12], 2)
    assert systemd.next(5) == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "w0 | w1"}
    assert gate.check([11, 13], 2)  # a restarted worker does not take readiness back
    # A reload: RELOADING=1 now, READY=1 once each worker has reloaded.
    gate.reloading()
    assert systemd.next(5)["RELOADING"] == "1"
    gate.heard(_ready(11, "w0"))
    assert not gate.check([11, 13], 2)
    gate.heard(_ready(13, "w1"))
    assert gate.check([11, 13], 2)
    assert systemd.next(5)["READY"] == "1"


def test_a_reload_while_starting_is_not_told(systemd: FakeSystemd) -> None:
    gate = WorkerGate(Notifier(systemd.name))
    gate.heard(_ready(11))
    gate.reloading()
    gate.heard(_ready(12))
    assert gate.check([11, 12], 2)
    assert systemd.next(5) == {"READY": "1", "MAINPID": str(os.getpid())}


# --- the servers, under a stand-in systemd ----------------------------------------


def _start(module: str, args: list[str], env: dict[str, str], stderr: Path) -> subprocess.Popen[bytes]:
    with stderr.open("wb") as err:
        return subprocess.Popen([*module_command(module), *args], env=env, stderr=err)


def _stop(proc: subprocess.Popen[bytes], systemd: FakeSystemd) -> None:
    proc.send_signal(signal.SIGTERM)  # by PID
    assert systemd.until("STOPPING") == {"STOPPING": "1"}
    assert proc.wait(timeout=60) == 0


def _accepts(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


@linux_only
def test_a_lone_heartbeat_says_ready_once_listening_and_stopping_on_sigterm(
    systemd: FakeSystemd, short_dir: Path
) -> None:
    pid_file = short_dir / "heartbeat.pid"
    log = short_dir / "stderr"
    proc = _start("servers.heartbeat", ["--port", "0", "--pid-file", str(pid_file)], systemd.env(), log)
    try:
        ready = systemd.until("READY")
        assert ready["MAINPID"] == str(proc.pid)
        (where,) = find_ready(ready["STATUS"], "heartbeat")  # STATUS names the address
        _accepts(where.port)  # right after READY=1: it already accepts
        assert pid_file.read_text() == f"{proc.pid}\n"
        proc.send_signal(signal.SIGHUP)
        assert "MONOTONIC_USEC" in systemd.until("RELOADING")
        assert systemd.until("READY")["MAINPID"] == str(proc.pid)
    finally:
        _stop(proc, systemd)
    assert not pid_file.exists()
    assert all(fields.get("MAINPID", str(proc.pid)) == str(proc.pid) for fields in systemd.heard)


@linux_only
def test_a_supervisor_says_ready_once_every_worker_listens_and_its_workers_never_speak(
    systemd: FakeSystemd, short_dir: Path
) -> None:
    port = free_port()
    pid_file = short_dir / "heartbeat.pid"
    log = short_dir / "stderr"
    env = systemd.env(WATCHDOG_USEC="400000")  # a ping every 0.2 s
    proc = _start("servers.heartbeat", ["--port", str(port), "--workers", "2", "--pid-file", str(pid_file)], env, log)
    try:
        ready = systemd.until("READY")
        # Each worker wrote its line before it told the supervisor, which told us after both.
        assert sorted(r.worker for r in find_ready(log.read_text(), "heartbeat")) == [0, 1]
        _accepts(port)
        assert ready["MAINPID"] == str(proc.pid)  # the supervisor: the PID systemd knows
        assert ready["STATUS"] == f"heartbeat: 2 workers listening on 127.0.0.1:{port}"
        assert pid_file.read_text() == f"{proc.pid}\n"
        systemd.until("WATCHDOG", timeout=5)
        proc.send_signal(signal.SIGHUP)  # passed on to the workers; READY=1 once both reloaded
        assert "MONOTONIC_USEC" in systemd.until("RELOADING")
        assert systemd.until("READY")["MAINPID"] == str(proc.pid)
    finally:
        _stop(proc, systemd)
    assert not pid_file.exists()
    assert sum("READY" in f for f in systemd.heard) == 2  # at start, after the reload: none from a worker
    assert all(f.get("MAINPID", str(proc.pid)) == str(proc.pid) for f in systemd.heard)


@linux_only
def test_the_http_server_notifies_an_abstract_socket(abstract_systemd: FakeSystemd, short_dir: Path) -> None:
    pid_file = short_dir / "http.pid"
    proc = _start(
        "servers.http", ["--port", "0", "--pid-file", str(pid_file)], abstract_systemd.env(), short_dir / "stderr"
    )
    try:
        ready = abstract_systemd.until("READY")
        assert ready["MAINPID"] == str(proc.pid)
        (where,) = find_ready(ready["STATUS"], "http")
        _accepts(where.port)
        assert pid_file.read_text() == f"{proc.pid}\n"
    finally:
        _stop(proc, abstract_systemd)
    assert not pid_file.exists()


@linux_only
def test_the_http_supervisor_notifies_once_both_workers_listen(systemd: FakeSystemd, short_dir: Path) -> None:
    port = free_port()
    proc = _start("servers.http", ["--port", str(port), "--workers", "2"], systemd.env(), short_dir / "stderr")
    try:
        ready = systemd.until("READY")
        _accepts(port)
        assert ready["MAINPID"] == str(proc.pid)
        assert ready["STATUS"] == f"http: 2 workers listening on 127.0.0.1:{port}"
    finally:
        _stop(proc, systemd)


@pytest.mark.parametrize("module", ["servers.heartbeat", "servers.http"])
def test_a_pid_file_that_cannot_be_written_is_refused_in_one_line(module: str, short_dir: Path) -> None:
    port = free_port()
    where = short_dir / "no-such-folder" / "server.pid"
    done = subprocess.run(
        [*module_command(module), "--port", str(port), "--pid-file", str(where)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "error: --pid-file: cannot write" in line and str(where) in line, line
    with socket.socket() as probe:  # nothing was bound
        probe.bind(("127.0.0.1", port))


# --- the console scripts and the unit files -------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_is_installed_and_answers(script: str) -> None:
    """The scripts pyproject.toml declares, installed beside this Python (the checkout's
    venv; tests/test_wheel.py checks a fresh install of the wheel)."""
    path = Path(sys.executable).parent / script
    if not path.exists():
        pytest.skip(f"{script} is not installed beside {sys.executable}")
    told = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    assert told.returncode == 0, told.stderr
    assert told.stdout.startswith(f"{script} ")
    helped = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and script in helped.stdout.splitlines()[0], helped.stderr


UNITS = {
    "idlekeeper-heartbeat.service": "servers.heartbeat.__main__",
    "idlekeeper-http.service": "servers.http.__main__",
}


def _unit(name: str) -> dict[str, list[str]]:
    """A unit file's assignments (a key given twice keeps both), sections ignored."""
    found: dict[str, list[str]] = {}
    for line in (ROOT / "contrib" / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.parametrize("name", sorted(UNITS))
def test_a_shipped_unit_runs_its_server_with_options_it_has(name: str) -> None:
    import importlib

    unit = _unit(name)
    assert unit["Type"] in (["notify"], ["notify-reload"])
    assert unit["KillMode"] == ["mixed"]  # the supervisor stops its workers itself
    (exec_start,) = unit["ExecStart"]
    program, *args = shlex.split(exec_start)
    assert Path(program).name == name.removesuffix(".service")
    parser = importlib.import_module(UNITS[name]).parser()
    known = parser._option_string_actions
    for arg in args:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in known, f"{name}: {arg} is no option of {Path(program).name}"
    # The stop timeout leaves the supervisor its whole grace before systemd's SIGKILL.
    stop = int(unit["TimeoutStopSec"][0].removesuffix("s"))
    grace = 45 if "heartbeat" in name else 15  # DRAIN_CAP + 15; --grace + 5
    assert stop > grace


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_finds_nothing_wrong_in_a_shipped_unit(name: str, tmp_path: Path) -> None:
    # verify wants the program to exist: point ExecStart at this checkout's script.
    text = (ROOT / "contrib" / "systemd" / name).read_text()
    script = Path(sys.executable).parent / name.removesuffix(".service")
    if not script.exists():
        pytest.skip(f"{script} is not installed")
    (tmp_path / name).write_text(text.replace(f"/opt/idlekeeper/.venv/bin/{script.name}", str(script)))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / name)], capture_output=True, text=True, timeout=60
    )
    # Only what it says of the unit: a sandbox without systemd running may add its own complaints.
    problems = [line for line in done.stderr.splitlines() if name in line]
    assert not problems, done.stderr
