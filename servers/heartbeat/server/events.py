"""The presence events a worker makes of its own connections (online when admitted,
offline or refused when ended) and hands to its coordinator."""

from __future__ import annotations

import dataclasses
import time

from ..config import HeartbeatConfig
from ..coordination import Coordinator
from ..mqtt.endings import Offline
from ..presence.event import REFUSED, PresenceEvent
from .connection import Connection

__all__ = ["REFUSALS", "ConnectionEvents"]

REFUSALS = {
    1: "unacceptable-protocol-version",
    2: "identifier-rejected",
    3: "server-unavailable",
    4: "bad-credentials",
    5: "not-authorized",
}
"""The refusal CONNACK codes (MQTT-3.2.2-3), by name, for a refusal's record."""


class ConnectionEvents:
    """Presence events of this worker's connections, stamped with its worker and node."""

    def __init__(self, config: HeartbeatConfig, coordinator: Coordinator) -> None:
        self.config = config
        self.coordinator = coordinator

    def ended(self, conn: Connection, reason: Offline, detail: str, was_online: bool) -> None:
        """Report the end of ``conn`` (``was_online``: its session was held here until now)."""
        if was_online and conn.online is not None:
            online = conn.online
            event = self.event(conn, "offline", reason, detail, epoch=online.epoch, username=online.username)
            # Exactly once, fleet-wide: the coordinator drops it if the session was already ended.
            self.coordinator.offline(event, forget=conn.session.assigned)
        elif reason is Offline.REFUSED or reason is Offline.SUPERSEDED or conn.session.client_id is not None:
            # A CONNECT that never made the connection its device: refused, superseded,
            # or lost (or broken) while its password or stored session was looked up.
            # Not the device's presence, since the id was only asked for, by whoever
            # knew it; but logged, so that every connection's end is in the log.
            self.coordinator.note(self.refused(conn, detail, reason))
        else:
            self.coordinator.note(self.event(conn, "offline", reason, detail))

    def refused(self, conn: Connection, detail: str, reason: Offline = Offline.REFUSED) -> PresenceEvent:
        """The record of a CONNECT refused, superseded, or lost before its CONNACK: status
        ``refused``, no client id (only the one claimed), so no reader takes it for the
        named device's presence; see :mod:`..presence`."""
        session = conn.session
        code = REFUSALS.get(conn.refusal, f"code-{conn.refusal}") if reason is Offline.REFUSED else reason.value
        claimed = "" if session.assigned or session.client_id is None else session.client_id
        event = self.event(conn, REFUSED, reason, f"{code}: {detail}" if detail else code)
        return dataclasses.replace(event, client_id=None, claimed_client_id=claimed)

    def event(
        self,
        conn: Connection,
        status: str,
        reason: Offline | None,
        detail: str = "",
        epoch: str = "",
        username: str = "",
        at: float | None = None,
    ) -> PresenceEvent:
        """An event of ``conn`` as it is now (how long silent, its keep-alive), stamped
        ``at`` (now unless given)."""
        cfg = self.config
        return PresenceEvent(
            status=status,
            client_id=conn.session.client_id,
            peer=conn.peer,
            reason=reason,
            silent_for=conn.silent_for(),
            time=time.time() if at is None else at,
            worker=cfg.worker,
            detail=detail,
            epoch=epoch,
            node=cfg.node,
            keep_alive=conn.session.keep_alive,
            username=username,
            protocol_level=conn.session.protocol_level if conn.session.client_id is not None else 0,
            reason_code=None if status == "online" else conn.session.reason_code,
            listener=conn.door.name,
        )
