"""Presence events: who came online, who went offline, why, and how long they were silent.

Pure data and sinks; the server decides when events happen. Each event reaches
MQTT subscribers (``$SYS/presence/<client-id>``, which a ``#`` subscription does not
match), a JSON-lines log and any Python callbacks registered by an embedding program.

An event's ``status`` is one of:

- ``"online"`` and ``"offline"``: presence. They name the device (``client_id``), go
  through the coordinator's registry (``/devices/<client-id>``, retained presence)
  and reach MQTT subscribers.
- ``"refused"``: not presence. A CONNECT was refused (bad password, connection cap,
  no stored session to be had), so the connection never was the device it named.
  The id it asked for is only a claim, anyone can type it, and it is kept apart in
  ``claimed_client_id``; ``client_id`` is None, so whoever reads the log by client
  id (or by status) never takes an attempt on a device's id for the device going
  offline. Refusals reach the sinks (the log) only: never the registry, retained
  presence or subscribers, so a flood of them neither displaces nor invents devices.
  ``reason`` is :attr:`Offline.REFUSED` and ``detail`` names the CONNACK code; or
  :attr:`Offline.SUPERSEDED` for a CONNECT dropped unanswered because a later
  connection of the same client id had already taken the session; or the reason a
  connection ended (``connection-lost``, ``protocol-error``...) after its CONNECT and
  before its CONNACK, while its password or stored session was being looked up.
  So every connection's end is in the log once: as ``offline`` or ``refused``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from ..mqtt.endings import Offline
from ..mqtt.v5.reason_codes import ReasonCode

__all__ = ["OFFLINE", "ONLINE", "REFUSED", "Offline", "PresenceEvent", "PresenceLog", "PresenceSink"]

ONLINE = "online"
"""Status of a session's start: the device is online."""
OFFLINE = "offline"
"""Status of a session's end (or of a socket that never identified itself)."""
REFUSED = "refused"
"""Status of a refused CONNECT: a security record, not presence (see the module docs)."""


@dataclass(frozen=True, slots=True)
class PresenceEvent:
    """One device coming online or going offline, or a refused CONNECT (not presence)."""

    status: str
    """:data:`ONLINE`, :data:`OFFLINE` or :data:`REFUSED`."""
    client_id: str | None
    """None for a socket that never identified itself, and for a refusal."""
    peer: str
    """``host:port`` of the device."""
    reason: Offline | None
    """Why it went offline; None for online."""
    silent_for: float
    """Seconds since the device's last packet, when the event happened."""
    time: float
    """Wall-clock time of the event (Unix seconds), for logs only."""
    worker: int = 0
    """The worker process that held the connection."""
    detail: str = ""
    """More about the reason (a protocol error's name, say)."""
    epoch: str = ""
    """The session: unique per accepted connection, fleet-wide. An online event and
    the one offline event that ends it carry the same epoch."""
    node: str = ""
    """The gateway that held the connection (empty on a lone machine)."""
    keep_alive: int = 0
    """The keep-alive the device asked for (after the server's cap), in seconds; an
    offline event carries its session's (0 for a socket that never identified itself)."""
    claimed_client_id: str = ""
    """A refusal's client id, as the refused CONNECT asked for it: a claim, not the device."""
    username: str = ""
    """The identity of the session's client certificate (its CN), when clients are
    identified by certificate (``--use-identity-as-username``); empty otherwise."""
    protocol_level: int = 0
    """The MQTT version the device spoke: 3 (3.1), 4 (3.1.1) or 5 (5.0); 0 if unknown."""
    reason_code: int | None = None
    """MQTT 5 only: the reason code that ended the session, whichever side sent it (the
    client's DISCONNECT, 0x04 publishing its Will; or the server's: 0x8D keep-alive
    timeout, 0x8E taken over, 0x8B shutting down, 0x81/0x82 its violation, ...)."""
    listener: str = ""
    """The listener the device came through (``mqtts://0.0.0.0:8883``); empty if unknown."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out: dict[str, Any] = {
            "status": self.status,
            "client_id": self.client_id,
            "peer": self.peer,
            "reason": None if self.reason is None else self.reason.value,
            "silent_for": round(self.silent_for, 3),
            "time": round(self.time, 3),
            "worker": self.worker,
        }
        if self.detail:
            out["detail"] = self.detail
        if self.epoch:
            out["epoch"] = self.epoch
        if self.node:
            out["node"] = self.node
        if self.status != REFUSED:
            # Offline events too: a supervisor's authority or a fleet's Redis knows a
            # device only by the events it was sent, and /devices/<id> shows its last.
            out["keep_alive"] = self.keep_alive
        if self.claimed_client_id:
            out["claimed_client_id"] = self.claimed_client_id
        if self.username:
            out["username"] = self.username
        if self.protocol_level:
            out["protocol_level"] = self.protocol_level
        if self.listener:
            out["listener"] = self.listener
        if self.reason_code is not None:
            out["reason_code"] = self.reason_code
            # 0x00 in a DISCONNECT (the only packet an offline event's code comes from
            # when it is 0) is "normal disconnection", not the table's first name.
            name = "normal-disconnection" if not self.reason_code else _label(self.reason_code)
            if name:
                out["reason_code_name"] = name
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PresenceEvent:
        """The inverse of :meth:`to_dict` (for events that crossed a process boundary)."""
        reason = data.get("reason")
        silent_for = float(data.get("silent_for", 0.0))
        return cls(
            # The supervisor keeps one of these for every device online: its status is
            # one of three words, and a fresh connection's silence is 0, so those are
            # shared rather than a new object each.
            status=sys.intern(str(data["status"])),
            client_id=None if data.get("client_id") is None else str(data["client_id"]),
            peer=str(data.get("peer", "?")),
            reason=None if reason is None else Offline(reason),
            silent_for=silent_for or 0.0,
            time=float(data.get("time", 0.0)),
            worker=int(data.get("worker", 0)),
            detail=str(data.get("detail", "")),
            epoch=str(data.get("epoch", "")),
            node=str(data.get("node", "")),
            keep_alive=int(data.get("keep_alive", 0)),
            claimed_client_id=str(data.get("claimed_client_id", "")),
            username=str(data.get("username", "")),
            protocol_level=int(data.get("protocol_level", 0)),
            reason_code=None if data.get("reason_code") is None else int(data["reason_code"]),
            # A few listeners name every device's: one string each, not one a device.
            listener=sys.intern(str(data.get("listener", ""))),
        )

    def payload(self) -> bytes:
        """The MQTT message body published on ``$SYS/presence/<client-id>`` (presence only)."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()


def _label(code: int) -> str:
    try:
        return ReasonCode(code).label
    except ValueError:
        return ""


PresenceSink = Callable[[PresenceEvent], None]
"""A callback that receives every presence event (it must not block)."""


class PresenceLog:
    """Writes presence events as JSON lines to a file or to stdout (``"-"``)."""

    def __init__(self, target: str) -> None:
        self._stream: IO[str] = sys.stdout if target == "-" else open(target, "a", buffering=1)  # noqa: SIM115
        self._owned = target != "-"
        self.path = None if target == "-" else target
        """The file's path (None: stdout)."""

    def size(self) -> int:
        """Bytes in the file so far (0 for stdout): a durable store reads the log from
        there after a crash, to tell nothing twice (:mod:`..coordination.durable.telling`)."""
        return 0 if self.path is None else os.fstat(self._stream.fileno()).st_size

    def __call__(self, event: PresenceEvent) -> None:
        self._stream.write(json.dumps(event.to_dict()) + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Close the file (not stdout)."""
        if self._owned:
            self._stream.close()
