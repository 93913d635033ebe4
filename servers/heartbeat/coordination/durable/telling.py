"""Presence events told once their record is on disk, and told at the next start if a
crash came between the two.

A presence event goes to the log and to subscribers once the commit that holds its
record is done: never a start told whose record a crash then loses. The event is
written in that commit too (the ``told`` table), and its row is deleted by a later
commit, once told. A crash after the commit but before the telling leaves the row: the
next start tells it then, unless the presence log already has it (the log's size at
each commit is kept, so only its tail since the last commit is read to find out). So
each event reaches the presence log once, whatever moment the crash picks.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from typing import Protocol

from ...presence.event import PresenceEvent
from .rows import event_of

__all__ = ["LogFile", "Telling"]


class LogFile(Protocol):
    """The presence log, as far as telling needs it (:class:`~...presence.event.PresenceLog`)."""

    @property
    def path(self) -> str | None: ...

    def size(self) -> int:
        """Bytes written so far (the file's size)."""
        ...


class Telling:
    """The events waiting for their commit, and those told since the last one."""

    def __init__(self, log: LogFile | None, next_seq: int) -> None:
        self.log = log
        self.next_seq = next_seq
        self._waiting: list[tuple[int, PresenceEvent, Callable[[], None]]] = []
        self._told: list[int] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, event: PresenceEvent, tell: Callable[[], None]) -> None:
        """``tell()`` tells ``event``: called once the next commit has it."""
        self._waiting.append((self.next_seq, event, tell))
        self.next_seq += 1

    def take(self) -> tuple[list[tuple[int, str]], list[tuple[int]], list[Callable[[], None]], str | None]:
        """For one commit: the events' rows, the rows of those told since the last commit
        (deleted), what tells the events after the commit, and where the log is now
        (``<size> <path>``; None without a log file)."""
        waiting, self._waiting = self._waiting, []
        rows = [(seq, json.dumps(event.to_dict(), separators=(",", ":"))) for seq, event, _ in waiting]
        told = self.told()
        actions = [self._telling(seq, tell) for seq, _, tell in waiting]
        where = None if self.log is None or self.log.path is None else f"{self.log.size()} {self.log.path}"
        return rows, told, actions, where

    def told(self) -> list[tuple[int]]:
        """The rows of the events told since the last :meth:`take` (for a last commit)."""
        told, self._told = [(seq,) for seq in self._told], []
        return told

    def _telling(self, seq: int, tell: Callable[[], None]) -> Callable[[], None]:
        def action() -> None:
            tell()
            self._told.append(seq)

        return action

    def untold(self, db: sqlite3.Connection, logged_to: str | None) -> list[PresenceEvent]:
        """The events a crash left between their commit and their telling (none of them
        in the presence log's tail since ``logged_to``, ``<size> <path>``, the log the
        last run wrote), in order; every row is then deleted."""
        waiting = [event_of(text) for (text,) in db.execute("SELECT event FROM told ORDER BY seq")]
        db.execute("DELETE FROM told")
        if not waiting:
            return []
        logged = _logged_since(logged_to)
        return [e for e in waiting if (e.epoch, e.status) not in logged]


def _logged_since(logged_to: str | None) -> set[tuple[str, str]]:
    """(epoch, status) of the events a presence log holds past an offset (``<size> <path>``)."""
    if not logged_to:
        return set()
    size, _, path = logged_to.partition(" ")
    offset = int(size)
    out: set[tuple[str, str]] = set()
    try:
        with open(path, "rb") as f:
            if offset > os.fstat(f.fileno()).st_size:
                return out  # rotated since: nothing to compare with
            f.seek(offset)
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut by the crash
                out.add((str(event.get("epoch", "")), str(event.get("status", ""))))
    except OSError:
        pass
    return out
