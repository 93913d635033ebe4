"""What changed since the last commit: the keys a durable store must write again.

Pure. The stores call it as they change (the registry per client id, the retention
per topic, the session store per session and its outboxes per message); a commit
takes what it holds (:meth:`Journal.take`) and writes the current state of each key,
so a key changed a hundred times between two commits is written once. A message is
written once when it is taken, updated in place when it is sent or released, and
deleted when it is acknowledged; one taken and acknowledged between two commits is
never written at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...broker.outbox import Message
from ...broker.persistent import StoredSession

__all__ = ["Journal", "SessionMessages", "Taken"]


class SessionMessages:
    """The journal of one persistent session's messages (its outbox's ``journal``)."""

    __slots__ = ("client_id", "dead", "journal")

    def __init__(self, journal: Journal, client_id: str) -> None:
        self.journal = journal
        self.client_id = client_id
        self.dead = False
        """The session was discarded: what it still reports is not written."""

    def kept(self, message: Message) -> None:
        """See :meth:`~...broker.outbox.MessageJournal.kept`."""
        journal = self.journal
        if not message.seq:
            message.seq = journal.next_seq
            journal.next_seq += 1
        journal.messages[message.seq] = (self, message, True)
        journal.mark()

    def changed(self, message: Message) -> None:
        """See :meth:`~...broker.outbox.MessageJournal.changed`."""
        journal = self.journal
        entry = journal.messages.get(message.seq)
        journal.messages[message.seq] = (self, message, entry is not None and entry[2])
        journal.mark()

    def gone(self, message: Message) -> None:
        """See :meth:`~...broker.outbox.MessageJournal.gone`."""
        journal = self.journal
        entry = journal.messages.get(message.seq)
        if entry is not None and entry[2]:
            del journal.messages[message.seq]  # never written: nothing to delete
        else:
            journal.messages[message.seq] = (self, None, False)
        journal.mark()


MessageEntry = tuple[SessionMessages, Message | None, bool]
"""A message's session, the message (None: delete it) and whether its row is new."""


@dataclass
class Taken:
    """The keys one commit writes (and gives back to the journal if the commit fails)."""

    topics: set[str] = field(default_factory=set)
    devices: set[str] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    dropped: list[int] = field(default_factory=list)
    """Messages of discarded sessions, deleted (by number: no index by client id to keep up)."""
    wills: set[str] = field(default_factory=set)
    """Client ids whose delayed Will was held or is done."""
    messages: dict[int, MessageEntry] = field(default_factory=dict)
    changes: int = 0
    """The journal's change count when they were taken: a commit of them makes every
    change up to it durable."""

    def __bool__(self) -> bool:
        return bool(self.topics or self.devices or self.sessions or self.dropped or self.messages or self.wills)


class Journal:
    """The keys changed since the last :meth:`take`; ``on_dirty`` is called when the
    first change after a take comes (to wake whoever commits)."""

    def __init__(self, next_seq: int = 1, on_dirty: Callable[[], None] | None = None) -> None:
        self.next_seq = next_seq
        self.on_dirty = on_dirty
        self.changes = 0
        """Changes made so far, ever: a PUBACK waits for a commit that covers its count."""
        self._taken = Taken()
        self.messages = self._taken.messages
        self._woken = False

    @property
    def dirty(self) -> bool:
        """Whether anything changed since the last take."""
        return bool(self._taken)

    def mark(self) -> None:
        """Count one change (the key has been noted by the caller)."""
        self.changes += 1
        if not self._woken:
            self._woken = True
            if self.on_dirty is not None:
                self.on_dirty()

    def topic(self, topic: str) -> None:
        """A retained topic changed."""
        self._taken.topics.add(topic)
        self.mark()

    def will(self, client_id: str) -> None:
        """A device's delayed Will was held, sent or dropped."""
        self._taken.wills.add(client_id)
        self.mark()

    def device(self, client_id: str) -> None:
        """A device's record was written or forgotten."""
        self._taken.devices.add(client_id)
        self.mark()

    # -- SessionJournal ------------------------------------------------------------------

    def session(self, client_id: str) -> None:
        """See :meth:`~...broker.persistent.SessionJournal.session`."""
        self._taken.sessions.add(client_id)
        self.mark()

    def opened(self, stored: StoredSession) -> SessionMessages:
        """See :meth:`~...broker.persistent.SessionJournal.opened`."""
        return SessionMessages(self, stored.client_id)

    def discarded(self, stored: StoredSession) -> None:
        """See :meth:`~...broker.persistent.SessionJournal.discarded`."""
        outbox = stored.outbox
        if isinstance(outbox.journal, SessionMessages):
            outbox.journal.dead = True
        self._taken.dropped += [m.seq for m in (*outbox.inflight(), *outbox.queued()) if m.seq]
        self.session(stored.client_id)

    # -- commits -------------------------------------------------------------------------

    def take(self) -> Taken:
        """Everything noted so far, for one commit; the journal starts empty again."""
        taken = self._taken
        taken.changes = self.changes
        self._taken = Taken(changes=self.changes)
        self.messages = self._taken.messages
        self._woken = False
        return taken

    def give_back(self, taken: Taken) -> None:
        """A commit of ``taken`` failed: its keys are written by the next one (whose
        state of each is the newest anyway)."""
        now = self._taken
        now.topics |= taken.topics
        now.devices |= taken.devices
        now.sessions |= taken.sessions
        now.dropped += taken.dropped
        now.wills |= taken.wills
        for seq, (owner, message, new) in taken.messages.items():
            later = now.messages.get(seq)
            if later is None:
                now.messages[seq] = (owner, message, new)
            elif new and later[1] is not None:
                now.messages[seq] = (later[0], later[1], True)  # its insert never happened
        if taken:
            self.mark()
