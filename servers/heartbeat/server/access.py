"""The ACL in force, as the server applies it: to one client's session, to the stores
that route to absent clients, and reloaded on SIGHUP.

Every check reads ``config.acl`` when it runs, so a reload applies to every client at
once; nothing here keeps a copy of the rules.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from ..config import HeartbeatConfig
from ..security.acl import AclFileError

__all__ = ["ClientRules", "acl_reader", "reload_acl"]

logger = logging.getLogger("servers.heartbeat")


class ClientRules:
    """The ACL as it applies to one client (its username and client id), for its session."""

    __slots__ = ("config", "username", "client_id")

    def __init__(self, config: HeartbeatConfig, username: str | None, client_id: str) -> None:
        self.config = config
        self.username = username
        self.client_id = client_id

    def may_subscribe(self, topic_filter: str) -> bool:
        """A read grant covers every topic of the filter (else 0x80 in SUBACK)."""
        acl = self.config.acl
        return acl is None or acl.can_read_filter(self.username, self.client_id, topic_filter)

    def may_publish(self, topic: str) -> bool:
        """The client may write ``topic`` (else its PUBLISH is dropped and counted)."""
        acl = self.config.acl
        return acl is None or acl.can_publish(self.username, self.client_id, topic)

    def may_read(self, topic: str) -> bool:
        """A message on ``topic`` may be delivered to the client (checked per message)."""
        acl = self.config.acl
        return acl is None or acl.can_read(self.username, self.client_id, topic)


def acl_reader(config: HeartbeatConfig) -> Callable[[str | None, str, str], bool] | None:
    """Whether (username, client id) may read a topic under the ACL in force, for the
    stores that route to absent clients; None when there is no ACL."""
    if config.acl is None:
        return None

    def may_read(username: str | None, client_id: str, topic: str) -> bool:
        acl = config.acl  # looked up each time: a SIGHUP reload replaces it
        return acl is None or acl.can_read(username, client_id, topic)

    return may_read


def reload_acl(config: HeartbeatConfig, counters: collections.Counter[str]) -> bool:
    """Re-read the ACL file (SIGHUP) into ``config``; a broken file keeps the rules in
    force (logged). Returns whether the rules were replaced (counted in ``acl_reloads``)."""
    acl = config.acl
    if acl is None:
        return False
    try:
        config.acl = acl.reload()
    except AclFileError as exc:
        logger.error("ACL file not reloaded, the old rules stay: %s", exc)
        return False
    counters["acl_reloads"] += 1
    logger.warning("ACL file reloaded: %d rules", len(config.acl.rules))
    return True
