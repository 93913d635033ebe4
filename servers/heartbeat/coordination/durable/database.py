"""The durable store's file: an SQLite database in WAL mode, its schema and its checks.

A file the server cannot trust is refused, never replaced: a silent fresh start
would throw away the state the operator kept it for. :func:`open_database` raises
:class:`StoreFileError` (one line naming the file and the reason) for a file that
is not SQLite, is corrupt, was written by a newer schema, belongs to another
program, or cannot be written.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3

__all__ = ["SCHEMA_VERSION", "StoreFileError", "lock_store", "open_database"]

SCHEMA_VERSION = 1
"""The schema this server writes (SQLite's ``user_version``); it reads no newer one."""

_APPLICATION_ID = 0x69646B31  # "idk1": the file is ours, whatever its name
_HEADER = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE retained (
    topic TEXT PRIMARY KEY, payload BLOB NOT NULL, qos INTEGER NOT NULL,
    expires_at REAL, owner TEXT NOT NULL, properties BLOB NOT NULL
);
CREATE TABLE devices (
    client_id TEXT PRIMARY KEY, event TEXT NOT NULL, once INTEGER NOT NULL, written INTEGER NOT NULL
);
CREATE INDEX devices_written ON devices (written);
CREATE TABLE sessions (
    client_id TEXT PRIMARY KEY, username TEXT, v5 INTEGER NOT NULL, expiry REAL NOT NULL,
    left_at REAL NOT NULL, subscriptions TEXT NOT NULL, inbound TEXT NOT NULL
);
CREATE TABLE messages (
    seq INTEGER PRIMARY KEY, client_id TEXT NOT NULL, topic TEXT NOT NULL, payload BLOB NOT NULL,
    qos INTEGER NOT NULL, retain INTEGER NOT NULL, properties BLOB, grp TEXT NOT NULL,
    packet_id INTEGER NOT NULL, stage INTEGER NOT NULL, born REAL
);
CREATE TABLE wills (
    client_id TEXT PRIMARY KEY, epoch TEXT NOT NULL, due REAL NOT NULL, topic TEXT NOT NULL,
    message BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL, properties BLOB NOT NULL,
    delay INTEGER NOT NULL, asked_delay INTEGER NOT NULL
);
CREATE TABLE told (seq INTEGER PRIMARY KEY, event TEXT NOT NULL);
"""


class StoreFileError(Exception):
    """The durable store's file cannot be used; the message names it and says why."""


def _refuse(path: str, why: str) -> StoreFileError:
    return StoreFileError(f"{path}: {why}")


def _check_header(path: str) -> bool:
    """Whether ``path`` exists with content; raises if that content is not SQLite's."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_HEADER))
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        raise _refuse(path, "is a directory, not a file") from None
    except OSError as exc:
        raise _refuse(path, f"cannot be read: {exc.strerror}") from None
    if not head:
        return False  # an empty file (touched by the operator): made a store
    if head != _HEADER:
        raise _refuse(path, "is not an SQLite database (refused rather than overwritten)")
    return True


def _check_place(path: str) -> bool:
    """Refuse a store whose folder is missing, whose file is not SQLite, or that cannot
    be written; whether the file exists (with content)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _refuse(path, f"its directory {parent} does not exist")
    existed = _check_header(path)
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise _refuse(path, "cannot be written: its filesystem is read-only")
    if not os.access(path if existed else parent, os.W_OK):
        raise _refuse(path, "cannot be written: permission denied" if existed else f"cannot be created in {parent}")
    return existed


def lock_store(path: str) -> int:
    """Take the store at ``path`` for this process (a lock on ``<path>.lock``, which the
    kernel lets go when the process ends, however it ends); returns the descriptor that
    holds it (close it to let go). Two servers writing one store would each overwrite
    what the other keeps, so the second is refused, naming the first's PID."""
    _check_place(path)
    lock = f"{path}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _refuse(path, f"cannot be locked ({lock}: {exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise _refuse(path, f"is in use by another server (pid {holder}): a store has one server") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def open_database(path: str, *, synchronous: str = "FULL", check: bool = True) -> sqlite3.Connection:
    """Open (or create) the store at ``path`` for writing, its schema checked (and the
    pages too, with ``check``: ``PRAGMA quick_check``). The connection may be used by
    one thread at a time, whichever (the writer's thread does the commits)."""
    existed = _check_place(path)
    try:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _refuse(path, f"cannot be opened: {exc}") from None
    try:
        _prepare(db, path, existed, synchronous, check)
    except BaseException:
        db.close()
        raise
    return db


def _prepare(db: sqlite3.Connection, path: str, existed: bool, synchronous: str, check: bool) -> None:
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        application = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.OperationalError as exc:
        raise _refuse(path, f"cannot be opened ({exc})") from None
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"is corrupt or not a database ({' '.join(str(exc).split())})") from None
    if existed and tables and application != _APPLICATION_ID:
        raise _refuse(path, "is an SQLite database of another program (refused rather than overwritten)")
    if version > SCHEMA_VERSION:
        raise _refuse(
            path, f"was written by a newer version (schema {version}; this server reads up to {SCHEMA_VERSION})"
        )
    if check and tables:
        try:
            verdict = [row[0] for row in db.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:
            raise _refuse(path, f"is corrupt ({exc})") from None
        if verdict != ["ok"]:
            found = "; ".join(" ".join(str(line).split()) for line in verdict[:3])
            raise _refuse(path, f"is corrupt ({found})")
    try:
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        db.execute(f"PRAGMA synchronous = {synchronous}")
        if tables:
            db.execute("BEGIN IMMEDIATE")  # fails here, not at the first commit, if it cannot be written
            db.execute("COMMIT")
        else:
            db.executescript(
                f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION};"
                f" PRAGMA application_id = {_APPLICATION_ID}; COMMIT;"
            )
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"cannot be written ({exc})") from None
    if mode.lower() != "wal":
        raise _refuse(path, f"cannot use write-ahead logging (journal mode {mode})")
