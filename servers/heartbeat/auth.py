"""Username/password authentication from a file of salted PBKDF2 hashes.

One user per line: ``username:pbkdf2_sha256$<iterations>$<salt>$<hash>`` (salt and
hash in URL-safe base64 without padding); blank lines and ``#`` comments are
ignored. Comparison is constant-time, and an unknown user costs the same PBKDF2 as a
known one, so timing does not reveal which names exist.

The default iteration count is deliberately modest: after an outage, hundreds of
thousands of devices reconnect at once, and each check runs PBKDF2. Choose more with
``--iterations`` where fewer devices and a stronger hash suit you better. Successful
checks are cached by (user, SHA-256 of the presented password), so a reconnect storm
does not recompute them; the cache forgets a user whose entry changes.

    python -m servers.heartbeat.auth add FILE USER      # password on stdin
    python -m servers.heartbeat.auth remove FILE USER
    python -m servers.heartbeat.auth check FILE USER    # exit 0 if accepted
"""

from __future__ import annotations

import argparse
import base64
import binascii
import enum
import hashlib
import hmac
import os
import secrets
import sys
import tempfile
from collections.abc import Iterable, Sequence

__all__ = ["DEFAULT_ITERATIONS", "AuthFileError", "AuthResult", "PasswordFile", "hash_password"]

DEFAULT_ITERATIONS = 1000
SCHEME = "pbkdf2_sha256"
_CACHE_LIMIT = 4096
_DUMMY_SALT = b"idlekeeper-dummy"


class AuthFileError(Exception):
    """The password file is malformed (the message names the file and line)."""


class AuthResult(enum.IntEnum):
    """The outcome of a check, valued as the CONNACK return code to send."""

    ACCEPTED = 0
    BAD_CREDENTIALS = 4
    NOT_AUTHORIZED = 5


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    # validate=True: a corrupt entry must be an error, not silently shortened.
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def hash_password(password: bytes, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """The stored form of ``password``: ``pbkdf2_sha256$<iterations>$<salt>$<hash>``."""
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password, salt, iterations)
    return f"{SCHEME}${iterations}${_b64(salt)}${_b64(digest)}"


class _Entry:
    __slots__ = ("digest", "iterations", "salt")

    def __init__(self, iterations: int, salt: bytes, digest: bytes) -> None:
        self.iterations = iterations
        self.salt = salt
        self.digest = digest

    @classmethod
    def parse(cls, stored: str) -> _Entry:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != SCHEME:
            raise ValueError(f"unknown scheme {scheme!r}")
        count = int(iterations)
        if count < 1:
            raise ValueError("iterations must be at least 1")
        return cls(count, _unb64(salt), _unb64(digest))

    def line(self) -> str:
        return f"{SCHEME}${self.iterations}${_b64(self.salt)}${_b64(self.digest)}"


class PasswordFile:
    """Users and their salted hashes; :meth:`check` answers a CONNECT's credentials."""

    def __init__(self) -> None:
        self._users: dict[str, _Entry] = {}
        self._cache: dict[tuple[str, bytes], None] = {}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PasswordFile:
        """Read a password file."""
        with open(path, encoding="utf-8") as f:
            return cls.from_lines(f, source=os.fspath(path))

    @classmethod
    def from_lines(cls, lines: Iterable[str], source: str = "<lines>") -> PasswordFile:
        """Parse password-file lines."""
        users = cls()
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, stored = line.partition(":")
            if not sep or not name:
                raise AuthFileError(f"{source}:{number}: expected 'username:{SCHEME}$...'")
            try:
                users._users[name] = _Entry.parse(stored)
            except (ValueError, TypeError, binascii.Error) as exc:
                raise AuthFileError(f"{source}:{number}: bad entry for {name!r} ({exc.__class__.__name__})") from None
        return users

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, username: object) -> bool:
        return username in self._users

    def set(self, username: str, password: bytes, *, iterations: int = DEFAULT_ITERATIONS) -> None:
        """Add or replace a user."""
        if not username or ":" in username or "\n" in username:
            raise ValueError("a username must be non-empty, without ':' or a newline")
        self._users[username] = _Entry.parse(hash_password(password, iterations=iterations))
        self._forget(username)

    def remove(self, username: str) -> bool:
        """Remove a user; returns whether it existed."""
        self._forget(username)
        return self._users.pop(username, None) is not None

    def check(self, username: str | None, password: bytes | None) -> AuthResult:
        """Whether these CONNECT credentials are accepted (and if not, the CONNACK code)."""
        if username is None:
            return AuthResult.NOT_AUTHORIZED
        presented = password or b""
        key = (username, hashlib.sha256(presented).digest())
        entry = self._users.get(username)
        if entry is not None and key in self._cache:
            return AuthResult.ACCEPTED
        if entry is None:
            hashlib.pbkdf2_hmac("sha256", presented, _DUMMY_SALT, DEFAULT_ITERATIONS)
            return AuthResult.BAD_CREDENTIALS
        digest = hashlib.pbkdf2_hmac("sha256", presented, entry.salt, entry.iterations)
        if password is None or not hmac.compare_digest(digest, entry.digest):
            return AuthResult.BAD_CREDENTIALS
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = None
        return AuthResult.ACCEPTED

    def _forget(self, username: str) -> None:
        for key in [k for k in self._cache if k[0] == username]:
            del self._cache[key]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the file atomically (temporary file, then rename), readable by its owner only."""
        target = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(target))
        fd, tmp = tempfile.mkstemp(prefix=".auth-", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for name, entry in sorted(self._users.items()):
                    f.write(f"{name}:{entry.line()}\n")
            os.chmod(tmp, 0o600)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m servers.heartbeat.auth``: manage a password file."""
    p = argparse.ArgumentParser(prog="python -m servers.heartbeat.auth", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("add", "add or replace USER; the password is read from stdin"),
        ("remove", "remove USER"),
        ("check", "check USER's password from stdin; exit 0 if accepted, 1 if not"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("file")
        cmd.add_argument("username")
        if name == "add":
            cmd.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="PBKDF2 iterations")
    args = p.parse_args(argv)
    try:
        users = PasswordFile.load(args.file) if os.path.exists(args.file) else PasswordFile()
        if args.command == "add":
            password = sys.stdin.readline().rstrip("\r\n").encode()
            users.set(args.username, password, iterations=args.iterations)
            users.save(args.file)
            return 0
        if args.command == "remove":
            if not users.remove(args.username):
                print(f"no user {args.username!r}", file=sys.stderr)
                return 1
            users.save(args.file)
            return 0
        password = sys.stdin.readline().rstrip("\r\n").encode()
        return 0 if users.check(args.username, password) is AuthResult.ACCEPTED else 1
    except (AuthFileError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
