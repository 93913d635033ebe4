"""The distribution as a pip user gets it (issue 61): the wheel built from this tree,
installed into fresh venvs outside the checkout, its console scripts run from a
directory that holds packages of its own named ``servers`` and ``loadtest``.

- with the ``loadtest`` extra (which brings ``servers``), every script's ``--help`` and
  ``--version``, and a short real run of each: an MQTT device and an HTTP request
  served by two workers, a password added, a load run of a few devices;
- with no extra, each command names the extra it needs, in one line.

It installs from PyPI (pip's cache makes later runs quick), so it is slow, not a
benchmark: what it guards is what a pip user meets first.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers.extras import version
from servers.readiness import find_ready

pytestmark = pytest.mark.slow

CHECKOUT = Path(__file__).resolve().parent.parent
SCRIPTS = ("idlekeeper-heartbeat", "idlekeeper-http", "idlekeeper-passwd", "idlekeeper-loadtest")


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True, timeout=900)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built from a copy of what it packages (the checkout is left alone)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    for package in ("idlekeeper", "servers", "loadtest"):
        shutil.copytree(CHECKOUT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    _pip(Path(sys.executable), "wheel", "--no-deps", "-w", str(out), str(source))
    (built,) = out.glob("idlekeeper-*.whl")
    return built


def _venv(where: Path, requirement: str) -> Path:
    venv.EnvBuilder(with_pip=True).create(where)
    _pip(where / "bin" / "python", "install", requirement)
    return where / "bin"


@pytest.fixture(scope="module")
def full(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel and its ``loadtest`` extra: its bin directory."""
    return _venv(tmp_path_factory.mktemp("venv-loadtest"), f"{wheel}[loadtest]")


@pytest.fixture(scope="module")
def bare(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel alone (trio, nothing else): its bin directory."""
    return _venv(tmp_path_factory.mktemp("venv-bare"), str(wheel))


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A working directory with its own ``servers`` and ``loadtest`` packages, which a
    script must not import in place of ours."""
    for name in ("servers", "loadtest"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('the user\\'s own {name} was imported')\n")
    yield tmp_path


def _run(bin_dir: Path, script: str, *args: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / script), *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_and_version_from_any_directory(full: Path, elsewhere: Path, script: str) -> None:
    helped = _run(full, script, "--help", cwd=elsewhere)
    assert helped.returncode == 0, helped.stderr
    assert script in helped.stdout.splitlines()[0]  # named as the operator ran it
    told = _run(full, script, "--version", cwd=elsewhere)
    assert told.returncode == 0, told.stderr
    assert told.stdout.strip() == f"{script} {version()}"


def _start(bin_dir: Path, script: str, *args: str, cwd: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """Start a server with two workers; its port once both say they listen."""
    proc = subprocess.Popen(
        [str(bin_dir / script), "--port", "0", "--workers", "2", *args],
        cwd=cwd,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
        ready = find_ready(seen)
        if len(ready) == 2:
            return proc, [r.port for r in ready]
    proc.kill()
    raise AssertionError(f"{script} did not start: {seen}")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)  # by PID
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_heartbeat_script_serves_a_device_with_two_workers(full: Path, elsewhere: Path) -> None:
    proc, ports = _start(full, "idlekeeper-heartbeat", cwd=elsewhere)
    try:
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as device:
            # CONNECT, MQTT 3.1.1, clean session, keep-alive 30, client id "wheel-1".
            device.sendall(bytes.fromhex("101300044d5154540402001e0007776865656c2d31"))
            assert device.recv(4) == bytes.fromhex("20020000")  # CONNACK, accepted
    finally:
        assert _stop(proc) == 0


def test_the_http_script_serves_a_request_with_two_workers(full: Path, elsewhere: Path) -> None:
    proc, ports = _start(full, "idlekeeper-http", cwd=elsewhere)
    try:
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as client:
            client.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 ")
    finally:
        assert _stop(proc) == 0


def test_the_passwd_script_adds_a_user_whose_password_then_checks(full: Path, elsewhere: Path) -> None:
    added = _run(
        full, "idlekeeper-passwd", "add", "passwords", "alice", "--iterations", "1000", cwd=elsewhere, stdin="pw\n"
    )
    assert added.returncode == 0, added.stderr
    checked = _run(full, "idlekeeper-passwd", "check", "passwords", "alice", cwd=elsewhere, stdin="pw\n")
    assert checked.returncode == 0, checked.stderr


def test_the_loadtest_script_runs_a_short_load(full: Path, elsewhere: Path) -> None:
    result = _run(
        full,
        "idlekeeper-loadtest",
        "devices",
        "--devices",
        "50",
        "--keepalive",
        "2",
        "--steady",
        "2",
        "--quiet",
        "--json",
        "report.json",
        cwd=elsewhere,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (elsewhere / "report.json").stat().st_size > 0
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("script", "extra"),
    [("idlekeeper-heartbeat", "servers"), ("idlekeeper-http", "servers"), ("idlekeeper-loadtest", "loadtest")],
)
def test_without_its_extra_a_script_names_it_in_one_line(bare: Path, elsewhere: Path, script: str, extra: str) -> None:
    result = _run(bare, script, *(["devices"] if script == "idlekeeper-loadtest" else ["--port", "0"]), cwd=elsewhere)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert len(lines) == 1, result.stderr
    assert f"pip install 'idlekeeper[{extra}]'" in lines[0]


def test_the_wheel_holds_no_test_or_benchmark_code(wheel: Path) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    assert "servers/page/static/index.html" in names or any(n.startswith("servers/page/static/") for n in names)
    assert any(n.startswith("servers/heartbeat/coordination/fleet/lua/") for n in names)
    assert os.path.basename(wheel).startswith(f"idlekeeper-{version()}-")
