"""Bearer tokens (RFC 6750) from a file, for the status endpoint: loaded, reloaded on
SIGHUP, and checked in constant time.

The file holds one token a line; ``#`` starts a comment (no token character is
``#``) and blank lines are skipped. No token is ever logged or put in an error
message: errors name the file and the line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re

from .textfiles import read_utf8

__all__ = ["TokenFile", "TokenFileError"]

logger = logging.getLogger("servers.status")

# RFC 6750's b64token: the characters a bearer token may have.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class TokenFileError(Exception):
    """A token file that cannot be read or has a line that is not a token."""


def _digest(token: str) -> bytes:
    # Compared as digests, so every comparison is of 32 bytes: a token's length
    # shows no more than its content does.
    return hashlib.sha256(token.encode()).digest()


class TokenFile:
    """The bearer tokens a status endpoint accepts, read from ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._digests: list[bytes] = self._read()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenFile:
        """The tokens in ``path``; :class:`TokenFileError` says why not."""
        return cls(path)

    def __len__(self) -> int:
        return len(self._digests)

    def _read(self) -> list[bytes]:
        lines = read_utf8(self.path, TokenFileError)[1].splitlines()
        digests = []
        for number, line in enumerate(lines, 1):
            token = line.partition("#")[0].strip()
            if not token:
                continue
            if not _TOKEN.fullmatch(token):
                raise TokenFileError(f"{self.path}:{number}: not a bearer token (letters, digits, -._~+/ then =)")
            digests.append(_digest(token))
        if not digests:
            raise TokenFileError(f"{self.path}: no tokens")
        return digests

    def reload(self) -> bool:
        """Re-read the file (SIGHUP); a broken one keeps the tokens in force (logged).
        Whether the tokens were replaced."""
        try:
            self._digests = self._read()
        except TokenFileError as exc:
            logger.error("status token file not reloaded, the old tokens stay: %s", exc)
            return False
        logger.warning("status token file reloaded: %d tokens", len(self._digests))
        return True

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the tokens.

        Every token is compared, each in constant time, so how long the check takes
        says nothing of which token, or how much of one, was right."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = _digest(token.strip())
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(presented, known)
        return found
