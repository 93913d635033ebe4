"""Where a fleet's Redis is: one server, or the primary a set of Sentinels names.

``--cluster`` takes either form:

- ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS): one Redis;
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the
  primary of ``service`` as the Sentinels at those addresses see it, followed through
  a failover. The credentials are the data servers'; Sentinels are asked without.
- ``redis+cluster://[user:password@]host:port[,host:port...][/?shards=N]``: a Redis
  Cluster, found through any of those nodes; presence is split into ``N`` shards
  (default 16, see :mod:`.shards`).

Pure: :func:`parse_target` turns the text into a :class:`RedisTarget`, or raises
``ValueError`` saying what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

__all__ = ["CLUSTER_SCHEME", "DEFAULT_SHARDS", "RedisTarget", "parse_target"]

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
DEFAULT_SHARDS = 16
"""Presence shards on a Redis Cluster when the URL does not say: several per primary
of a small cluster, so a resharding can move part of the load."""


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
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    """A Redis Cluster's nodes to start from; empty if it is not a cluster."""
    shards: int = 0
    """Presence shards on a Redis Cluster (0: not a cluster, one Redis's layout)."""

    @property
    def sentinel(self) -> bool:
        """Whether the primary is found through Sentinels."""
        return bool(self.sentinels)

    @property
    def cluster(self) -> bool:
        """Whether it is a Redis Cluster."""
        return bool(self.cluster_nodes)

    def describe(self) -> str:
        """For logs and the status page: no password."""
        if self.cluster:
            where = ",".join(f"{h}:{p}" for h, p in self.cluster_nodes)
            return f"{CLUSTER_SCHEME}://{where}/?shards={self.shards}"
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


def _credentials(authority: str) -> tuple[str, str | None, str | None]:
    """``authority`` without its ``user:password@``, and those two."""
    if "@" not in authority:
        return authority, None, None
    credentials, _, authority = authority.rpartition("@")
    user, colon, secret = credentials.partition(":")
    return authority, unquote(user) or None, unquote(secret) if colon else None


def _addresses(authority: str, url: str, what: str) -> tuple[tuple[str, int], ...]:
    found = []
    for item in authority.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host:
            raise ValueError(f"{url!r}: each {what} is host:port, not {item.strip()!r}")
        found.append((host.strip("[]"), _port(port, url)))
    return tuple(found)


def _cluster(url: str, rest: str) -> RedisTarget:
    authority, _, tail = rest.partition("/")
    authority, username, password = _credentials(authority)
    nodes = _addresses(authority, url, "cluster node")
    path, _, query = tail.partition("?")
    if path.strip("/"):
        raise ValueError(f"{url!r}: a Redis Cluster has no databases; nothing may follow the nodes but ?shards=N")
    shards = DEFAULT_SHARDS
    for item in filter(None, query.split("&")):
        name, _, value = item.partition("=")
        if name != "shards":
            raise ValueError(f"{url!r}: unknown option {name!r} (shards)")
        if not value.isdigit() or not 1 <= int(value) <= 1024:
            raise ValueError(f"{url!r}: shards={value!r} is not a number from 1 to 1024")
        shards = int(value)
    return RedisTarget(url, username=username, password=password, cluster_nodes=nodes, shards=shards)


def parse_target(url: str) -> RedisTarget:
    """The target ``url`` names; ``ValueError`` with the reason if it names none."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(
            f"{url!r}: expected redis://host:port/db, {SENTINEL_SCHEME}://host:port,.../service/db "
            f"or {CLUSTER_SCHEME}://host:port,..."
        )
    if scheme in ("redis", "rediss", "unix"):
        return RedisTarget(url)
    if scheme == CLUSTER_SCHEME:
        return _cluster(url, rest)
    if scheme != SENTINEL_SCHEME:
        raise ValueError(
            f"{url!r}: unknown scheme {scheme!r} (redis, rediss, unix, {SENTINEL_SCHEME} or {CLUSTER_SCHEME})"
        )
    authority, _, path = rest.partition("/")
    authority, username, password = _credentials(authority)
    sentinels = _addresses(authority, url, "Sentinel")
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
    return RedisTarget(url, sentinels, unquote(parts[0]), db, username, password)
