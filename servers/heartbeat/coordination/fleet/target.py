"""Where a fleet's Redis is: one server, or the primary a set of Sentinels names.

``--cluster`` takes either form:

- ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS): one Redis;
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the
  primary of ``service`` as the Sentinels at those addresses see it, followed through
  a failover. The credentials are the data servers'; Sentinels are asked without.

Pure: :func:`parse_target` turns the text into a :class:`RedisTarget`, or raises
``ValueError`` saying what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

__all__ = ["RedisTarget", "parse_target"]

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed ``--cluster`` URL."""

    url: str
    """As given (a plain one is handed to the client as it is)."""
    sentinels: tuple[tuple[str, int], ...] = ()
    """The Sentinels' addresses; empty for one Redis."""
    service: str = ""
    """The name the Sentinels monitor the primary under."""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def sentinel(self) -> bool:
        """Whether the primary is found through Sentinels."""
        return bool(self.sentinels)

    def describe(self) -> str:
        """For logs and the status page: no password."""
        if not self.sentinel:
            parts = urlsplit(self.url)
            host = parts.hostname or "?"
            return f"{parts.scheme}://{host}:{parts.port or 6379}{parts.path}"
        where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{where}/{self.service}/{self.db}"


def _port(text: str, url: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{url!r}: {text!r} is not a port") from None
    if not 0 < port < 65536:
        raise ValueError(f"{url!r}: port {port} is out of range")
    return port


def parse_target(url: str) -> RedisTarget:
    """The target ``url`` names; ``ValueError`` with the reason if it names none."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r}: expected redis://host:port/db or {SENTINEL_SCHEME}://host:port,.../service/db")
    if scheme in ("redis", "rediss", "unix"):
        return RedisTarget(url)
    if scheme != SENTINEL_SCHEME:
        raise ValueError(f"{url!r}: unknown scheme {scheme!r} (redis, rediss, unix or {SENTINEL_SCHEME})")
    authority, _, path = rest.partition("/")
    username = password = None
    if "@" in authority:
        credentials, _, authority = authority.rpartition("@")
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = []
    for item in authority.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host:
            raise ValueError(f"{url!r}: each Sentinel is host:port, not {item.strip()!r}")
        sentinels.append((host.strip("[]"), _port(port, url)))
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"{url!r}: the service name the Sentinels monitor is missing (.../service/db)")
    if len(parts) > 2:
        raise ValueError(f"{url!r}: expected .../service/db after the Sentinels")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"{url!r}: the database {parts[1]!r} is not a number")
        db = int(parts[1])
    return RedisTarget(url, tuple(sentinels), unquote(parts[0]), db, username, password)
