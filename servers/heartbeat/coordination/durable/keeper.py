"""The durable store of one box: restore at start, group commits, a clean close.

A :class:`Durability` is made by whichever coordinator owns the state (a lone
worker's, the supervisor's authority). It restores what the file holds into that
coordinator's registry, retention and session store, and from then on is told of
every change (:mod:`.journal`). A commit runs in two halves: :meth:`Durability.collect`
reads the changed state into rows, on the owner's thread (the state is not shared);
:meth:`Durability.write` puts them in one transaction, on any thread, while the owner
goes on; :meth:`Durability.done` takes the outcome back. What changes meanwhile goes
in the next commit: that is the group commit.

A commit that fails (a full disk, an I/O error) is retried with everything since;
meanwhile the store says so (:attr:`Durability.failure`), and the owner refuses what
it cannot make durable, until a commit succeeds again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...broker.outbox import Stage
from ...broker.persistent import SessionStore
from ...mqtt.endings import Offline
from ...presence.event import PresenceEvent
from ..registry import Registry
from ..retention import Retention
from .database import lock_store, open_database
from .journal import Journal, Taken
from .rows import Clocks, MessageRow, SessionRow, device_row, event_of, message_row, session_of, session_row
from .telling import Telling
from .wills import HeldWill, WillRow, held_will_of, will_row

__all__ = ["SYNC_MODES", "Batch", "Durability", "Restored"]

logger = logging.getLogger("servers.heartbeat.durable")

SYNC_MODES = ("always", "interval", "off")
"""``--persistence-sync``: a PUBACK waits for its group's commit (``always``); commits
on a timer, PUBACKs not waiting (``interval``); at shutdown and every autosave
interval only, as Mosquitto (``off``)."""


@dataclass
class Restored:
    """What a start found in the store."""

    devices: int = 0
    retained: int = 0
    sessions: int = 0
    messages: int = 0
    expired_sessions: int = 0
    ended: list[PresenceEvent] = field(default_factory=list)
    """Offline events of the devices that were online when the server stopped or died,
    to publish before anything else (``server-shutdown`` or ``server-lost``)."""
    wills: int = 0
    """Delayed Wills still waiting (:attr:`Durability.wills`)."""
    untold: list[PresenceEvent] = field(default_factory=list)
    """Events committed but never told (a crash came between): to tell first."""
    seconds: float = 0.0


@dataclass
class Batch:
    """One commit's rows."""

    taken: Taken
    retained: list[tuple[str, bytes, int, float | None, str, bytes]] = field(default_factory=list)
    unretained: list[tuple[str]] = field(default_factory=list)
    devices: list[tuple[str, str, int, int]] = field(default_factory=list)
    forgotten: list[tuple[str]] = field(default_factory=list)
    sessions: list[SessionRow] = field(default_factory=list)
    ended: list[tuple[str]] = field(default_factory=list)
    inserted: list[MessageRow] = field(default_factory=list)
    updated: list[tuple[int, bytes | None, int, int]] = field(default_factory=list)
    deleted: list[tuple[int]] = field(default_factory=list)
    """Messages acknowledged, expired, or of a discarded session."""
    wills: list[WillRow] = field(default_factory=list)
    wills_done: list[tuple[str]] = field(default_factory=list)
    alive: float = 0.0
    told: list[tuple[int, str]] = field(default_factory=list)
    told_done: list[tuple[int]] = field(default_factory=list)
    logged_to: str | None = None
    later: list[Callable[[], None]] = field(default_factory=list)
    """What waited for this commit (:meth:`Durability.later`)."""

    def statements(self) -> list[tuple[str, list[Any]]]:
        """The commit's statements, in the order they run, each with its rows."""
        return [
            ("INSERT OR REPLACE INTO retained VALUES (?, ?, ?, ?, ?, ?)", self.retained),
            ("DELETE FROM retained WHERE topic = ?", self.unretained),
            ("INSERT OR REPLACE INTO devices VALUES (?, ?, ?, ?)", self.devices),
            ("DELETE FROM devices WHERE client_id = ?", self.forgotten),
            ("DELETE FROM sessions WHERE client_id = ?", self.ended),
            ("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)", self.sessions),
            ("INSERT OR REPLACE INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", self.inserted),
            ("UPDATE messages SET packet_id = ?, properties = ?, stage = ? WHERE seq = ?", self.updated),
            ("DELETE FROM messages WHERE seq = ?", self.deleted),
            ("INSERT OR REPLACE INTO wills VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", self.wills),
            ("DELETE FROM wills WHERE client_id = ?", self.wills_done),
            ("INSERT INTO told VALUES (?, ?)", self.told),
            ("DELETE FROM told WHERE seq = ?", self.told_done),
        ]

    @property
    def rows(self) -> int:
        """Rows written or deleted."""
        return sum(len(rows) for _, rows in self.statements())


class Durability:
    """The durable store at ``path`` for one owner of the state (see the module's docstring).

    ``store_clock`` is the session store's clock (the owner's: trio's for a lone
    worker, the wall for the authority); ``outbox_clock`` the outboxes' (MQTT 5
    Message Expiry), monotonic unless a test says otherwise.
    """

    def __init__(
        self,
        path: str,
        *,
        sync: str = "always",
        interval: float = 0.1,
        autosave: float = 1800.0,
        store_clock: Callable[[], float] = time.time,
        outbox_clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        check: bool = True,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync: one of {', '.join(SYNC_MODES)}, not {sync!r}")
        self.path = path
        self.sync = sync
        self.interval = interval
        """Seconds between commits in ``interval`` mode."""
        self.autosave = autosave
        """Seconds between commits in ``off`` mode (Mosquitto's ``autosave_interval``)."""
        self.store_clock = store_clock
        self.outbox_clock = outbox_clock
        self.wall_clock = wall_clock
        self._lock = lock_store(path)
        try:
            # ``check``: its pages read through first (a caller that just did may skip it).
            self.db = open_database(path, synchronous="NORMAL" if sync == "off" else "FULL", check=check)
        except BaseException:
            os.close(self._lock)
            raise
        self.journal = Journal(next_seq=self._max("SELECT MAX(seq) FROM messages") + 1)
        self._written = self._max("SELECT MAX(written) FROM devices")
        self.committed = 0
        """The journal's change count the last successful commit covered."""
        self.failure: str | None = None
        """Why the last commit failed (None: it did not)."""
        self.commits = 0
        self.failures = 0
        self.rows = 0
        self.commit_seconds = 0.0
        self.last_commit = 0.0
        """When the last successful commit ended (wall)."""
        self._later: list[Callable[[], None]] = []
        self.telling = Telling(None, self._max("SELECT MAX(seq) FROM told") + 1)
        """Presence events waiting for their commit to be told (its ``log``: the presence
        log, set by the coordinator before :meth:`restore`)."""
        self.wills: dict[str, HeldWill] = {}
        """MQTT 5 delayed Wills waiting, by client id (see :meth:`will_held`)."""
        self._registry: Registry | None = None
        self._retention: Retention | None = None
        self._store: SessionStore | None = None

    def _max(self, query: str) -> int:
        value = self.db.execute(query).fetchone()[0]
        return int(value or 0)

    # -- start ---------------------------------------------------------------------------

    def restore(self, registry: Registry, retention: Retention, store: SessionStore) -> Restored:
        """Load the file into the owner's state, then follow its changes. Devices online
        when the server stopped (or died) are ended, once, ``server-shutdown`` (or
        ``server-lost``), at the time it stopped (or last committed)."""
        started = time.perf_counter()
        db = self.db
        out = Restored()
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        clean = meta.get("state") == "stopped"
        ended_at = float(meta.get("stopped_at" if clean else "alive", self.wall_clock()))
        clocks = self._clocks()
        for _client_id, text, once in db.execute("SELECT client_id, event, once FROM devices ORDER BY written"):
            registry.restore(event_of(text), bool(once))
            out.devices += 1
        db.execute("DELETE FROM retained WHERE expires_at IS NOT NULL AND expires_at <= ?", (clocks.wall,))
        for topic, payload, qos, expires_at, owner, properties in db.execute("SELECT * FROM retained"):
            retention.store.store(topic, payload, qos, clocks.wall, expires_at, owner, properties)
            out.retained += 1
        messages: dict[str, list[MessageRow]] = {}
        for row in db.execute("SELECT * FROM messages ORDER BY seq"):
            messages.setdefault(row[1], []).append(row)
        self._follow(registry, retention, store)  # sessions adopted from here on are followed
        gone: list[str] = []
        for row in db.execute("SELECT * FROM sessions").fetchall():
            stored, options = session_of(row, messages.pop(row[0], ()), store, clocks, ended_at, self.outbox_clock)
            if stored.left_at + stored.expiry <= clocks.store:
                out.expired_sessions += 1
                gone.append(stored.client_id)
                continue
            store.adopt(stored, options)
            out.sessions += 1
            out.messages += len(stored.outbox)
        for row in db.execute("SELECT * FROM wills"):
            held = held_will_of(row)
            self.wills[held.client_id] = held
        out.wills = len(self.wills)
        out.untold = self.telling.untold(db, meta.get("logged_to"))
        if gone or messages:  # sessions expired while the server was down, or messages of none
            db.executemany("DELETE FROM sessions WHERE client_id = ?", [(c,) for c in gone])
            db.execute("DELETE FROM messages WHERE client_id NOT IN (SELECT client_id FROM sessions)")
        reason, detail = (
            (Offline.SERVER_SHUTDOWN, "the server was stopped while it was online")
            if clean
            else (Offline.SERVER_LOST, "the server died while it was online")
        )
        out.ended = registry.lose(lambda event: True, reason, detail, ended_at)
        self._mark_running()
        out.seconds = time.perf_counter() - started
        return out

    def _follow(self, registry: Registry, retention: Retention, store: SessionStore) -> None:
        self._registry, self._retention, self._store = registry, retention, store
        journal = self.journal
        registry.changed = journal.device
        retention.changed = journal.topic
        store.journal = journal

    def will_held(self, held: HeldWill) -> None:
        """A worker holds a Will for its delay: kept until :meth:`will_done`."""
        self.wills[held.client_id] = held
        self.journal.will(held.client_id)

    def will_done(self, client_id: str, epoch: str) -> None:
        """The Will session ``epoch`` of ``client_id`` left was sent or dropped."""
        held = self.wills.get(client_id)
        if held is not None and held.epoch == epoch:
            del self.wills[client_id]
            self.journal.will(client_id)

    def _mark_running(self) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self._meta({"state": "running", "alive": repr(self.wall_clock())})

    def _meta(self, values: dict[str, str]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", values.items())

    def _clocks(self) -> Clocks:
        return Clocks(self.wall_clock(), self.store_clock(), self.outbox_clock())

    # -- commits -------------------------------------------------------------------------

    @property
    def changes(self) -> int:
        """Changes made so far: a PUBACK that waits for durability waits for this count."""
        return self.journal.changes

    def due(self) -> bool:
        """Whether anything waits to be committed."""
        return self.journal.dirty or bool(self.telling)

    def tell_later(self, event: PresenceEvent, tell: Callable[[], None]) -> bool:
        """Call ``tell()`` (which tells ``event``) once the changes made so far are on disk
        (see :mod:`.telling`); False if nothing waits, or in sync ``off``: then tell it now."""
        if self.sync == "off" or not self.journal.dirty:
            return False
        self.telling.add(event, tell)
        return True

    def later(self, action: Callable[[], None], modes: tuple[str, ...] = ("always", "interval")) -> bool:
        """Run ``action`` once the changes made so far are committed (after the commit
        that takes them, even a failed one: the server goes on meanwhile); False if
        nothing waits, or the sync mode is not among ``modes``: then do it now.

        What others are told goes through here: a presence event is published, and a
        persistent session's packets are sent, once the record they tell of is on disk,
        so a crash never leaves a told start without a told end, or a QoS 2 message
        released on the wire and queued on disk."""
        if self.sync not in modes or not self.journal.dirty:
            return False
        self._later.append(action)
        return True

    def collect(self) -> Batch:
        """The rows of everything changed since the last collect (on the owner's thread)."""
        taken = self.journal.take()
        told, told_done, telling, logged_to = self.telling.take()
        batch = Batch(taken, alive=self.wall_clock(), told=told, told_done=told_done, logged_to=logged_to)
        batch.later, self._later = telling + self._later, []
        clocks = self._clocks()
        retention, registry, store = self._retention, self._registry, self._store
        assert retention is not None and registry is not None and store is not None
        for topic in taken.topics:
            entry = retention.store.get(topic, clocks.wall)
            if entry is None:
                batch.unretained.append((topic,))
            else:
                batch.retained.append(
                    (entry.topic, entry.payload, entry.qos, entry.expires_at, entry.owner, entry.properties)
                )
        for client_id in taken.devices:
            event = registry.get(client_id)
            if event is None:
                batch.forgotten.append((client_id,))
            else:
                self._written += 1
                batch.devices.append(device_row(event, registry.seen_once(client_id), self._written))
        batch.deleted = [(seq,) for seq in taken.dropped]
        for client_id in taken.wills:
            held = self.wills.get(client_id)
            if held is None:
                batch.wills_done.append((client_id,))
            else:
                batch.wills.append(will_row(held))
        for client_id in taken.sessions:
            stored = store.get(client_id)
            if stored is None:
                batch.ended.append((client_id,))
            else:
                batch.sessions.append(session_row(stored, store.subscriptions.options(client_id), clocks))
        for seq, (owner, message, new) in taken.messages.items():
            if owner.dead:
                continue
            if message is None:
                batch.deleted.append((seq,))
            elif new:
                batch.inserted.append(message_row(owner.client_id, message, clocks))
            else:
                batch.updated.append((message.packet_id, message.properties, int(message.stage is Stage.RELEASED), seq))
        return batch

    def write(self, batch: Batch) -> None:
        """Commit ``batch`` in one transaction (any thread; one at a time). Raises what
        SQLite raises (``sqlite3.OperationalError`` for a full disk)."""
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            for statement, rows in batch.statements():
                if rows:
                    db.executemany(statement, rows)
            meta = [("alive", repr(batch.alive))]
            if batch.logged_to is not None:
                meta.append(("logged_to", batch.logged_to))
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                # The rollback of a failed write may fail as well; the next BEGIN resets.
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def done(self, batch: Batch, error: BaseException | None, seconds: float = 0.0) -> None:
        """The outcome of :meth:`write` (on the owner's thread): counted, a failed
        batch's keys go back to the journal for the next commit, and what waited for
        it is done."""
        try:
            self._done(batch, error, seconds)
        finally:
            for action in batch.later:
                try:
                    action()
                except Exception:
                    logger.exception("durable store %s: an action after a commit raised", self.path)

    def _done(self, batch: Batch, error: BaseException | None, seconds: float) -> None:
        if error is None:
            self.commits += 1
            self.rows += batch.rows
            self.commit_seconds += seconds
            self.committed = max(self.committed, batch.taken.changes)
            self.last_commit = self.wall_clock()
            if self.failure is not None:
                logger.warning("durable store %s: writing again (%s before)", self.path, self.failure)
                self.failure = None
                self._writable(True)
            return
        self.failures += 1
        self.journal.give_back(batch.taken)
        why = str(error) or type(error).__name__
        if self.failure is None:
            logger.error(
                "durable store %s: a commit failed (%s): retained updates and messages for absent"
                " sessions are refused until it writes again; retrying",
                self.path,
                why,
            )
            self._writable(False)
        self.failure = why

    def _writable(self, writable: bool) -> None:
        if self._retention is not None:
            self._retention.writable = writable
        if self._store is not None:
            self._store.keeps_absent = writable

    def commit(self) -> bool:
        """Collect and write on this thread; whether it succeeded (or nothing was due)."""
        if not self.due():
            return self.failure is None
        batch = self.collect()
        started = time.perf_counter()
        try:
            self.write(batch)
        except (sqlite3.Error, OSError) as exc:
            self.done(batch, exc)
            return False
        self.done(batch, None, time.perf_counter() - started)
        return True

    def abandon(self) -> None:
        """Let go of the file as a crash does: no last commit, not marked stopped (the
        next start says ``server-lost``). For tests, and a process that must go at once."""
        self.db.close()
        os.close(self._lock)

    def close(self, clean: bool) -> None:
        """A last commit, and the file marked stopped if ``clean`` (the server was asked
        to stop): the next start then says ``server-shutdown``, not ``server-lost``."""
        self.commit()
        if clean and self.failure is None:
            try:
                with self.db:
                    self.db.execute("BEGIN IMMEDIATE")
                    self.db.executemany("DELETE FROM told WHERE seq = ?", self.telling.told())
                    self._meta({"state": "stopped", "stopped_at": repr(self.wall_clock())})
            except sqlite3.Error as exc:
                logger.error("durable store %s: could not be marked stopped (%s)", self.path, exc)
        self.db.close()
        os.close(self._lock)
