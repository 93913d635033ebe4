"""Username/password authentication from a password file.

One user per line, ``username:<hash>``; blank lines and ``#`` comments are ignored,
and blanks around the username are trimmed (as Mosquitto does). Three forms of hash
may be mixed in one file:

- ``pbkdf2_sha256$<iterations>$<salt>$<hash>``: ours, PBKDF2-HMAC-SHA256, salt and
  hash in URL-safe base64 without padding (``python -m servers.heartbeat.auth add``);
- ``$7$<iterations>$<salt>$<hash>``: Mosquitto's ``sha512-pbkdf2``, the default of
  ``mosquitto_passwd`` since 2.0: PBKDF2-HMAC-SHA512 with a 12- or 64-byte salt and a
  64-byte hash, in standard base64;
- ``$6$<salt>$<hash>``: Mosquitto's older ``sha512`` (1.6 and before): one SHA-512 of
  the password followed by the salt. Accepted so that old files keep working, but one
  SHA-512 is no defence if the file leaks: rehash those users.

So a file made by ``mosquitto_passwd`` serves as it is. Mosquitto 2.1's ``$argon2id$``
is refused with a message saying so. A password is hashed as the bytes the client
sent (Mosquitto's C code stops at a zero byte; no ``mosquitto_passwd`` password has one).

Comparison is constant-time, and an unknown user costs a hash of the file's most
common kind and cost, so timing does not reveal which names exist.

The default cost of a new entry is OWASP's for PBKDF2-HMAC-SHA256 (600,000 rounds),
which makes each check take a good fraction of a second of CPU. A device that has
connected is remembered (its username with a keyed digest of the password it proved,
one per user), so a reconnect storm after a network outage costs no hashing; after a
restart every device is hashed once, and after a reload (SIGHUP) only the users whose
entry changed. Fleets of devices with random tokens, which need no stretching, can
choose fewer rounds with ``--iterations``.

The command :mod:`servers.heartbeat.auth` writes and checks these files.
"""

from __future__ import annotations

import base64
import binascii
import collections
import enum
import hashlib
import hmac
import io
import os
import secrets
import tempfile
from collections.abc import Iterable, Sequence

from ...textfiles import read_utf8

__all__ = ["DEFAULT_ITERATIONS", "SCHEME", "AuthFileError", "AuthResult", "PasswordFile", "hash_password"]

DEFAULT_ITERATIONS = 600_000
"""PBKDF2-HMAC-SHA256 rounds of a new entry (OWASP's recommendation of 2023)."""
SCHEME = "pbkdf2_sha256"
_SHA512_LEN = 64
_MOSQUITTO_SALTS = (12, 64)  # what Mosquitto 2.0 writes, and what 2.1 writes for $6$


class AuthFileError(Exception):
    """The password file is unreadable or malformed (the message names the file, and the line)."""


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


def _std_b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _std_unb64(text: str, lengths: Sequence[int], what: str) -> bytes:
    raw = base64.b64decode(text, validate=True)
    if len(raw) not in lengths:
        raise ValueError(f"{what} of {len(raw)} bytes")
    return raw


def hash_password(password: bytes, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """The stored form of ``password``: ``pbkdf2_sha256$<iterations>$<salt>$<hash>``."""
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password, salt, iterations)
    return f"{SCHEME}${iterations}${_b64(salt)}${_b64(digest)}"


class _Hash:
    """One stored password hash; :meth:`verify` is the slow part."""

    __slots__ = ("digest", "salt")

    def __init__(self, salt: bytes, digest: bytes) -> None:
        self.salt = salt
        self.digest = digest

    def compute(self, password: bytes) -> bytes:
        raise NotImplementedError

    def verify(self, password: bytes) -> bool:
        """Whether ``password`` matches, compared in constant time."""
        return hmac.compare_digest(self.compute(password), self.digest)

    def line(self) -> str:
        """The stored form, as read (so a file round-trips)."""
        raise NotImplementedError

    def cost(self) -> tuple[str, int]:
        """Its kind and work factor, to pick the decoy for unknown users."""
        raise NotImplementedError

    def decoy(self) -> _Hash:
        """A hash of the same kind and cost that no password matches."""
        raise NotImplementedError


class _Pbkdf2(_Hash):
    """PBKDF2-HMAC: ours (SHA-256) or Mosquitto's ``$7$`` (SHA-512)."""

    __slots__ = ("iterations", "mosquitto")

    def __init__(self, iterations: int, salt: bytes, digest: bytes, *, mosquitto: bool) -> None:
        super().__init__(salt, digest)
        if iterations < 1:
            raise ValueError("iterations must be at least 1")
        self.iterations = iterations
        self.mosquitto = mosquitto

    @classmethod
    def ours(cls, stored: str) -> _Pbkdf2:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != SCHEME:
            raise ValueError(f"unknown scheme {scheme!r}")
        return cls(int(iterations), _unb64(salt), _unb64(digest), mosquitto=False)

    @classmethod
    def mosquitto_7(cls, stored: str) -> _Pbkdf2:
        iterations, salt, digest = stored.split("$")
        return cls(
            int(iterations),
            _std_unb64(salt, _MOSQUITTO_SALTS, "salt"),
            _std_unb64(digest, (_SHA512_LEN,), "hash"),
            mosquitto=True,
        )

    def compute(self, password: bytes) -> bytes:
        algorithm = "sha512" if self.mosquitto else "sha256"
        return hashlib.pbkdf2_hmac(algorithm, password, self.salt, self.iterations)

    def line(self) -> str:
        if self.mosquitto:
            return f"$7${self.iterations}${_std_b64(self.salt)}${_std_b64(self.digest)}"
        return f"{SCHEME}${self.iterations}${_b64(self.salt)}${_b64(self.digest)}"

    def cost(self) -> tuple[str, int]:
        return ("$7$" if self.mosquitto else SCHEME, self.iterations)

    def decoy(self) -> _Hash:
        return _Pbkdf2(
            self.iterations,
            secrets.token_bytes(len(self.salt)),
            secrets.token_bytes(len(self.digest)),
            mosquitto=self.mosquitto,
        )


class _Sha512(_Hash):
    """Mosquitto's ``$6$``: SHA-512 of the password, then the salt."""

    __slots__ = ()

    @classmethod
    def mosquitto_6(cls, stored: str) -> _Sha512:
        salt, digest = stored.split("$")
        return cls(_std_unb64(salt, _MOSQUITTO_SALTS, "salt"), _std_unb64(digest, (_SHA512_LEN,), "hash"))

    def compute(self, password: bytes) -> bytes:
        return hashlib.sha512(password + self.salt).digest()

    def line(self) -> str:
        return f"$6${_std_b64(self.salt)}${_std_b64(self.digest)}"

    def cost(self) -> tuple[str, int]:
        return ("$6$", 1)

    def decoy(self) -> _Hash:
        return _Sha512(secrets.token_bytes(len(self.salt)), secrets.token_bytes(_SHA512_LEN))


def _parse(stored: str) -> _Hash:
    if stored.startswith("$7$"):
        return _Pbkdf2.mosquitto_7(stored[3:])
    if stored.startswith("$6$"):
        return _Sha512.mosquitto_6(stored[3:])
    if stored.startswith("$argon2"):
        raise ValueError("argon2id (Mosquitto 2.1) is not supported: rehash with mosquitto_passwd -H sha512-pbkdf2")
    return _Pbkdf2.ours(stored)


class PasswordFile:
    """Users and their salted hashes; :meth:`check` answers a CONNECT's credentials.

    :meth:`check` is :meth:`cached` (fast), else :meth:`verify` (slow: the server runs
    it in a worker thread). Both are safe to call from another thread while the file
    is read or reloaded: each cache entry is one dict item, written and read whole,
    and :meth:`reload` replaces the users' dict whole.
    """

    def __init__(self) -> None:
        self.path: str | None = None
        """The file :meth:`load` read, which :meth:`reload` reads again (None: not from a file)."""
        self._users: dict[str, _Hash] = {}
        self.last_reload = (0, 0, 0)
        """Users added, removed and whose password changed at the last :meth:`reload`."""
        # username -> (the entry it was verified against, keyed digest of the password).
        # Keyed with a secret of this process, so a memory dump shows no fast hash of a
        # password; at most one item per user, so the file bounds it.
        self._cache: dict[str, tuple[_Hash, bytes]] = {}
        self._key = secrets.token_bytes(32)
        self._decoy: _Hash | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PasswordFile:
        """Read a password file; :class:`AuthFileError` if it is unreadable or malformed."""
        name, text = read_utf8(path, AuthFileError)
        # newline=None: lines end where a file opened in text mode would end them.
        users = cls.from_lines(io.StringIO(text, newline=None), source=name)
        users.path = name
        return users

    def reload(self) -> int:
        """Read :attr:`path` again and serve its users instead; returns how many there are.

        All or nothing: a file that cannot be read or has a bad line raises
        :class:`AuthFileError` and leaves the users as they were. A user whose entry did
        not change keeps the password it proved, so a reload costs no hashing storm when
        the devices next reconnect; a changed or removed user's does not survive.
        """
        if self.path is None:
            raise ValueError("this PasswordFile was not loaded from a file")
        fresh = PasswordFile.load(self.path)._users
        changed = 0
        for name, entry in fresh.items():
            old = self._users.get(name)
            if old is not None and old.line() == entry.line():
                fresh[name] = old  # the cache names its entry: the same object keeps it valid
            elif old is not None:
                changed += 1
        added = len(fresh.keys() - self._users.keys())
        self.last_reload = (added, len(self._users.keys() - fresh.keys()), changed)
        # One assignment each: a check in a worker thread sees the old users or the new.
        self._users = fresh
        self._cache = {name: hit for name, hit in self._cache.copy().items() if fresh.get(name) is hit[0]}
        self._decoy = None
        return len(fresh)

    @classmethod
    def from_lines(cls, lines: Iterable[str], source: str = "<lines>") -> PasswordFile:
        """Parse password-file lines."""
        users = cls()
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, stored = line.partition(":")
            name = name.strip()
            if not sep or not name:
                raise AuthFileError(f"{source}:{number}: expected 'username:{SCHEME}$...' or 'username:$7$...'")
            try:
                users._users[name] = _parse(stored.strip())
            except (ValueError, TypeError, binascii.Error) as exc:
                detail = str(exc) if "argon2" in str(exc) else exc.__class__.__name__
                raise AuthFileError(f"{source}:{number}: bad entry for {name!r} ({detail})") from None
        return users

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, username: object) -> bool:
        return username in self._users

    def set(self, username: str, password: bytes, *, iterations: int = DEFAULT_ITERATIONS) -> None:
        """Add or replace a user (in our PBKDF2-HMAC-SHA256 form)."""
        if not username or ":" in username or "\n" in username or username != username.strip():
            raise ValueError("a username must be non-empty, without ':', a newline or blanks at either end")
        self._users[username] = _Pbkdf2.ours(hash_password(password, iterations=iterations))
        self._changed(username)

    def remove(self, username: str) -> bool:
        """Remove a user; returns whether it existed."""
        self._changed(username)
        return self._users.pop(username, None) is not None

    def _changed(self, username: str) -> None:
        self._cache.pop(username, None)
        self._decoy = None

    def _keyed(self, password: bytes) -> bytes:
        return hmac.new(self._key, password, hashlib.sha256).digest()

    def cached(self, username: str | None, password: bytes | None) -> bool:
        """Whether exactly these credentials were verified before (against the user's
        current entry): cheap, no password hashing."""
        if username is None or password is None:
            return False
        hit = self._cache.get(username)
        if hit is None or hit[0] is not self._users.get(username):
            return False
        return hmac.compare_digest(hit[1], self._keyed(password))

    def verify(self, username: str | None, password: bytes | None) -> AuthResult:
        """Check the password against the stored hash (slow on purpose); remembers an
        accepted one for :meth:`cached`."""
        if username is None:
            return AuthResult.NOT_AUTHORIZED
        presented = password or b""
        entry = self._users.get(username)
        if entry is None:
            self._decoy_for_unknown().verify(presented)
            return AuthResult.BAD_CREDENTIALS
        if not entry.verify(presented) or password is None:
            return AuthResult.BAD_CREDENTIALS
        self._cache[username] = (entry, self._keyed(presented))
        return AuthResult.ACCEPTED

    def check(self, username: str | None, password: bytes | None) -> AuthResult:
        """Whether these CONNECT credentials are accepted (and if not, the CONNACK code)."""
        if self.cached(username, password):
            return AuthResult.ACCEPTED
        return self.verify(username, password)

    def _decoy_for_unknown(self) -> _Hash:
        decoy = self._decoy
        if decoy is None:
            costs = collections.Counter(entry.cost() for entry in self._users.values())
            if costs:
                typical = costs.most_common(1)[0][0]
                decoy = next(e for e in self._users.values() if e.cost() == typical).decoy()
            else:
                decoy = _Pbkdf2(DEFAULT_ITERATIONS, secrets.token_bytes(16), secrets.token_bytes(32), mosquitto=False)
            self._decoy = decoy
        return decoy

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
