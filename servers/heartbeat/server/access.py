"""The ACL in force, as the server applies it: to one client's session, to the stores
that route to absent clients, and reloaded on SIGHUP.

Every check reads ``config.acl`` when it runs, so a reload applies to every client at
once; nothing here keeps a copy of the rules.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from ..config import HeartbeatConfig
from ..security.acl import AclFile, AclFileError

__all__ = ["ClientRules", "acl_reader", "reload_acl"]

logger = logging.getLogger("servers.heartbeat")


class HoldsAcl(Protocol):
    """Where the ACL in force is read: the configuration, or a listener (its own or the server's)."""

    @property
    def acl(self) -> AclFile | None: ...


class HoldsOwnAcl(Protocol):
    """What holds an ACL that a reload replaces: the configuration, or a listener's own."""

    acl: AclFile | None


class ClientRules:
    """The ACL as it applies to one client (its username and client id), for its session."""

    __slots__ = ("config", "username", "client_id")

    def __init__(self, config: HoldsAcl, username: str | None, client_id: str) -> None:
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


def acl_reader(
    config: HeartbeatConfig, listeners: Sequence[HoldsAcl] = ()
) -> Callable[[str | None, str, str], bool] | None:
    """Whether (username, client id) may read a topic under the ACL in force, for the
    stores that route to absent clients; None when there is no ACL.

    Where listeners have ACLs of their own (``per_listener_settings``), an absent
    client's listener is not known: a message queued for it must pass every listener's
    ACL, so that no listener's rules are ever bypassed (one may drop what the client's
    own listener would have let through: documented)."""
    holders: list[HoldsAcl] = [config, *listeners]
    if all(holder.acl is None for holder in holders):
        return None

    def may_read(username: str | None, client_id: str, topic: str) -> bool:
        for holder in holders:
            acl = holder.acl  # looked up each time: a SIGHUP reload replaces it
            if acl is not None and not acl.can_read(username, client_id, topic):
                return False
        return True

    return may_read


def reload_acl(holder: HoldsOwnAcl, counters: collections.Counter[str], name: str = "") -> bool:
    """Re-read the ACL file (SIGHUP) into ``holder`` (the configuration, or a listener
    named ``name``); a broken file keeps the rules in force (logged). Returns whether the
    rules were replaced (counted in ``acl_reloads``), and logs what changed."""
    acl = holder.acl
    if acl is None:
        return False
    whose = f" of listener {name}" if name else ""
    try:
        holder.acl = fresh = acl.reload()
    except AclFileError as exc:
        logger.error("ACL file%s not reloaded, the old rules stay: %s", whose, exc)
        return False
    counters["acl_reloads"] += 1
    before, after = set(map(repr, acl.rules)), set(map(repr, fresh.rules))
    logger.warning(
        "ACL file%s reloaded: %d rules (%d added, %d removed)",
        whose,
        len(fresh.rules),
        len(after - before),
        len(before - after),
    )
    return True
