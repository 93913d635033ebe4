"""One client id's persistent session as a :class:`~.persistent.SessionStore` keeps it
(:class:`StoredSession`), and who is told when one changes (:class:`SessionJournal`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from .outbox import MessageJournal, Outbox

__all__ = ["SessionJournal", "StoredSession"]


class SessionJournal(Protocol):
    """Who is told of every change to the sessions, so that a durable store writes only
    the sessions that changed (:mod:`..coordination.durable`)."""

    def session(self, client_id: str) -> None:
        """The session of ``client_id`` changed (or is gone): its record is written again."""
        ...

    def opened(self, stored: StoredSession) -> MessageJournal:
        """A new session: the journal of its messages."""
        ...

    def discarded(self, stored: StoredSession) -> None:
        """``stored`` is gone, and every message it held."""
        ...


class StoredSession:
    """One client id's persistent state."""

    __slots__ = (
        "client_id",
        "username",
        "subscriptions",
        "outbox",
        "inbound",
        "holder",
        "left_at",
        "drop_logged",
        "v5",
        "expiry",
        "reopened",
    )

    def __init__(
        self, client_id: str, outbox: Outbox, username: str | None = None, v5: bool = False, expiry: float = 0.0
    ) -> None:
        self.client_id = client_id
        self.username = username
        """Who the client last authenticated as (access rules apply per message)."""
        self.subscriptions: dict[str, int] = {}
        self.outbox = outbox
        self.inbound: set[int] = set()
        """QoS 2 packet ids received (PUBREC sent) whose PUBREL has not come."""
        self.holder: Hashable | None = None
        """Who holds the client's connection now (an epoch); None while it is away."""
        self.left_at = 0.0
        self.drop_logged = False
        self.v5 = v5
        """Whether the client last connected with MQTT 5.0 (its messages are written so)."""
        self.expiry = expiry
        """Seconds the session outlives its client's connection (0: it ends with it)."""
        self.reopened = False
        """A newer connection resumed it while an older one held it (a takeover, or a
        reconnect whose older connection's end is still on its way): until the newer
        one's CONNACK, the older one's end neither ends it nor sets its expiry."""

    def speak(self, v5: bool) -> None:
        """The client (re)connected with MQTT 5.0 (``v5``) or 3.1.x: what it is owed is
        written in that version from now on (a 3.1.x PUBLISH has no room for properties)."""
        if v5 == self.v5:
            return
        self.v5 = v5
        journal = self.outbox.journal
        for message in (*self.outbox.inflight(), *self.outbox.queued()):
            message.properties = (message.properties or b"") if v5 else None
            if journal is not None:
                journal.changed(message)
