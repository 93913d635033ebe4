"""A one-box server's state, durable: retained messages, persistent sessions, every
device's last presence, in an embedded SQLite file (``--persistence FILE``).

The coordinator that owns the state (a lone worker's, or the supervisor's authority)
keeps it in memory as before; a :class:`~.journal.Journal` is told of every change
(which topic, which device, which session, which message), and the
:class:`~.keeper.Durability` writes just those in one transaction, a group at a time:
whatever changed while the last commit was being written goes in the next one. A
PUBACK for a message that changed what is kept waits for its group's commit (sync
``always``); ``interval`` commits on a timer, and ``off`` at shutdown and every
autosave interval, as Mosquitto does. See docs/explanation/durability.md.

Its modules, one job each: :mod:`.database` (the file, its schema and refusals),
:mod:`.journal` (what changed), :mod:`.rows` (the state as rows and back),
:mod:`.keeper` (restore, commits, close), :mod:`.telling` (events told once on disk),
:mod:`.wills` (delayed Wills as rows), all pure but for the file; :mod:`.driver` (a trio
worker's commits, in a thread) and :mod:`.box` (the supervisor's, in line).
"""

from __future__ import annotations

from .database import SCHEMA_VERSION, StoreFileError, lock_store, open_database
from .keeper import SYNC_MODES, Durability, Restored

__all__ = ["SCHEMA_VERSION", "SYNC_MODES", "Durability", "Restored", "StoreFileError", "lock_store", "open_database"]
