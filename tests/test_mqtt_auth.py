"""The password file: salted hashes, constant-time checks, the cache and the CLI."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from servers.heartbeat import auth
from servers.heartbeat.auth import AuthFileError, AuthResult, PasswordFile

ROOT = Path(__file__).resolve().parent.parent


def test_check_outcomes() -> None:
    users = PasswordFile()
    users.set("alice", b"wonder")
    assert users.check("alice", b"wonder") is AuthResult.ACCEPTED
    assert users.check("alice", b"wrong") is AuthResult.BAD_CREDENTIALS
    assert users.check("bob", b"wonder") is AuthResult.BAD_CREDENTIALS
    assert users.check("alice", None) is AuthResult.BAD_CREDENTIALS
    assert users.check(None, None) is AuthResult.NOT_AUTHORIZED
    assert "alice" in users and len(users) == 1


def test_hashes_are_salted_and_never_plain() -> None:
    one, two = auth.hash_password(b"secret"), auth.hash_password(b"secret")
    assert one != two
    assert "secret" not in one
    assert one.startswith("pbkdf2_sha256$1000$")


def test_file_round_trip_and_mode(tmp_path: Path) -> None:
    users = PasswordFile()
    users.set("a", b"1")
    users.set("b:c".replace(":", "-"), b"2")
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
    ],
)
def test_malformed_lines_name_the_line(line: str) -> None:
    with pytest.raises(AuthFileError, match=r"users:3"):
        PasswordFile.from_lines(["# comment", "", line], source="users")


def test_cache_skips_pbkdf2_and_forgets_changed_users(monkeypatch: pytest.MonkeyPatch) -> None:
    users = PasswordFile()
    users.set("dev", b"pw")
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
    users.set("dev", b"new")
    assert users.check("dev", b"pw") is AuthResult.BAD_CREDENTIALS


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
