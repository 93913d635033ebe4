"""Who a connecting client is and whether its credentials hold: the password check
(hashed off the event loop, a few at a time, throttled per source address and per
username) or the identity its TLS certificate proved."""

from __future__ import annotations

import collections
import logging
import re
from typing import Protocol

import trio

import idlekeeper

from ...logs import shown
from ..config import HeartbeatConfig
from ..mqtt.effects import Accept
from ..mqtt.policy import utf8_length
from ..security.passwords import AuthFileError, AuthResult, PasswordFile
from ..security.throttle import Admission, AuthGate, Hold, source_key
from .connection import Connection, peer_closed, peer_of

__all__ = ["Authenticator"]

logger = logging.getLogger("servers.heartbeat")

# What a certificate's CN may not hold when it stands for the username: what the
# CONNECT's reader refuses in one (controls, non-characters' neighbours U+0000 and
# the C1 block), and a wildcard, which would take the client's ACL patterns away.
_UNFIT_NAME = re.compile("[+#\x00-\x1f\x7f-\x9f]")


class HoldsAuth(Protocol):
    """What holds a password file: the configuration, or a listener's own."""

    auth: PasswordFile | None


class Authenticator:
    """A worker's credential checks, with their throttle and their threads.

    ``counters`` is the worker's (``auth_*`` are counted there).
    """

    def __init__(self, config: HeartbeatConfig, counters: collections.Counter[str]) -> None:
        self.config = config
        self.counters = counters
        self.gate = AuthGate(config.auth_throttle) if config.auth_throttle is not None else None
        """Failed password checks per source address and per username, and their delays."""
        # Checks wait their turn here; the second limiter only gives the threads their
        # own pool (never contended: the first admits as many).
        self.turns = trio.CapacityLimiter(config.auth_threads)
        self._threads = trio.CapacityLimiter(config.auth_threads)

    def username(self, conn: Connection, request: Accept) -> str | None:
        """Who the client is, for ACLs and presence: its certificate's CN when clients
        are identified by certificate (the CONNECT's username is then ignored), else
        the CONNECT's username."""
        if conn.door.identified_by_certificate:
            stream = conn.stream
            return idlekeeper.peer_common_name(stream if isinstance(stream, idlekeeper.Transport) else stream.stream)
        return request.username

    def certified(self, conn: Connection, request: Accept) -> int:
        """When clients are identified by certificate: 0, or 4 (bad credentials) for a
        certificate whose (first) CN is missing, empty, or holds what no username may
        (``+``, ``#``, a control character), or is longer than a username may be. The
        certificate was the credential, checked at the handshake (Mosquitto's
        use_identity_as_username: no password file)."""
        name = self.username(conn, request)
        if not name or _UNFIT_NAME.search(name) is not None or utf8_length(name) > self.config.max_username:
            return 4
        return 0

    def reload(self, holder: HoldsAuth | None = None, name: str = "") -> bool:
        """Re-read the password file (SIGHUP; the server's, or that of ``holder``, the
        listener named ``name``), as Mosquitto re-reads its password_file; returns
        whether its users replaced those in force (counted in ``auth_reloads``), and logs
        how many users were added, removed or changed.

        A file that cannot be read or has a bad line keeps the users in force, logged in
        one line naming the file and the line. Only CONNECTs from now on see the change:
        a connection already accepted stays, whatever happened to its user.
        """
        auth = (holder or self.config).auth
        if auth is None or auth.path is None:
            return False
        whose = f" of listener {name}" if name else ""
        try:
            users = auth.reload()
        except AuthFileError as exc:
            logger.error("password file%s not reloaded, the old users stay: %s", whose, exc)
            return False
        self.counters["auth_reloads"] += 1
        added, removed, changed = auth.last_reload
        logger.warning(
            "password file%s reloaded: %d users (%d added, %d removed, %d changed)",
            whose,
            users,
            added,
            removed,
            changed,
        )
        return True

    async def check(self, conn: Connection, request: Accept) -> int:
        """The password check; 0 if accepted, else the CONNACK refusal code.

        Credentials verified before are accepted without hashing (the file's cache);
        others are hashed in a worker thread, ``auth_threads`` at a time, so the event
        loop never hashes. The throttle (:mod:`..security.throttle`) refuses, unchecked and with
        the same code as a wrong password, what comes from a source address or for a
        username that failed too often; it is asked again when a queued check's turn
        comes, so a burst queued before the first failures were counted is not hashed
        either, nor is the check of a client that has hung up meanwhile.
        """
        door = conn.door
        auth = door.auth
        username, password = request.username, request.password
        if username is None:
            if door.allow_anonymous:
                return 0
            self.counters["auth_failures"] += 1
            return int(AuthResult.NOT_AUTHORIZED)
        if auth is None:
            if door.allow_anonymous:
                return 0
            # Mosquitto's rule: anonymous clients are refused, and no file can prove a name.
            self.counters["auth_failures"] += 1
            return int(AuthResult.NOT_AUTHORIZED)
        source = source_key(peer_of(conn.stream, port=False))
        verdict = self._before_hashing(auth, source, username, password)
        if verdict is not None:
            return verdict
        gate = self.gate
        async with self.turns:
            verdict = self._before_hashing(auth, source, username, password)
            if verdict is not None:
                return verdict
            if peer_closed(conn.stream):
                self.counters["auth_abandoned"] += 1
                return int(AuthResult.BAD_CREDENTIALS)
            hold = gate.begin(source, username, trio.current_time()) if gate is not None else Hold(False, False)
            self.counters["auth_checks"] += 1
            try:
                result = await trio.to_thread.run_sync(auth.verify, username, password, limiter=self._threads)
            except BaseException:
                if gate is not None:
                    gate.abandon(source, username, hold)
                raise
        accepted = result is AuthResult.ACCEPTED
        if gate is not None:
            gate.outcome(source, username, trio.current_time(), accepted, hold)
        if accepted:
            return 0
        self.counters["auth_failures"] += 1
        if gate is not None:
            now = trio.current_time()
            delay = max(gate.sources.wait(source, now), gate.users.wait(username, now))
            if delay > 0:
                logger.info("password of %s from %s refused: more checks wait %.1f s", shown(username), source, delay)
        return int(result)

    def _before_hashing(self, auth: PasswordFile, source: str, username: str, password: bytes | None) -> int | None:
        """0 to accept (verified before), a refusal code (throttled), or None to check
        the password."""
        known = auth.cached(username, password)
        gate = self.gate
        verdict = (
            Admission.CHECK if gate is None else gate.admit(source, username, trio.current_time(), known_good=known)
        )
        if known and verdict is not Admission.REFUSE_SOURCE:
            self.counters["auth_cache_hits"] += 1
            return 0
        if verdict is Admission.CHECK:
            return None
        self.counters["auth_throttled"] += 1
        return int(AuthResult.BAD_CREDENTIALS)
