"""Brute-force throttling of password checks, sans-IO: failures per key, a growing delay.

A :class:`Throttle` counts the failed password checks of one kind of key (source
addresses, or usernames). A key's first ``free`` failures cost nothing; from then on
each failure shuts the key out for a delay that doubles, from ``base`` up to ``cap``
seconds; a key with no failure for ``forget`` seconds starts afresh. While a key's
delay runs, no password of it is checked at all: an attempt is refused without the
hash being computed, so a flood costs the server nothing and, since the answer cannot
depend on the password, tells the attacker nothing. Once the delay has passed, one
check at a time is let through for a throttled key (:meth:`Throttle.begin`), so a
burst of connections timed for that moment gets one guess, not one each.

Memory is bounded: at most ``max_keys`` keys are remembered, the one whose last
failure is oldest is forgotten first, and keys whose failures have been forgotten
are dropped as newer ones come.

:class:`AuthGate` applies the policy to a CONNECT, from a source address and for a
username, and says whether to accept it at once (credentials verified before), check
its password, or refuse it unchecked. See :meth:`AuthGate.admit` for why a username
under attack does not lock its real device out.

Time is passed in (trio's clock in the server), so a test drives it as it likes.
"""

from __future__ import annotations

import collections
import enum
import ipaddress
from dataclasses import dataclass

__all__ = ["Admission", "AuthGate", "Hold", "Throttle", "ThrottlePolicy", "source_key"]


@dataclass(frozen=True)
class ThrottlePolicy:
    """How failures turn into delays (the same for addresses and usernames)."""

    free: int = 5
    """Failures a key may make before its first delay."""
    base: float = 1.0
    """The first delay, in seconds; each further failure doubles it."""
    cap: float = 60.0
    """The longest delay, in seconds."""
    forget: float = 900.0
    """Seconds without a failure after which a key's failures are forgotten."""
    max_keys: int = 65_536
    """Keys remembered per kind; beyond, the one whose last failure is oldest is forgotten."""

    def __post_init__(self) -> None:
        if self.free < 1:
            raise ValueError(f"free must be at least 1, not {self.free}")
        if not 0 < self.base <= self.cap:
            raise ValueError(f"need 0 < base <= cap, not base={self.base}, cap={self.cap}")
        if self.forget < self.cap:
            raise ValueError(f"forget ({self.forget}) must be at least cap ({self.cap})")
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {self.max_keys}")

    def delay(self, failures: int) -> float:
        """Seconds a key is shut out after its ``failures``-th failure in a row."""
        if failures < self.free:
            return 0.0
        # The exponent is clamped: past 2**64 every sane cap has long been reached.
        return min(self.cap, self.base * 2.0 ** min(failures - self.free, 64))


class _Record:
    __slots__ = ("failures", "held", "last", "until")

    def __init__(self) -> None:
        self.failures = 0
        self.last = 0.0
        """When the last failure was counted."""
        self.until = 0.0
        """The delay of the last failure ends then."""
        self.held = 0.0
        """A check under way holds the key until then (or its outcome)."""

    def free_at(self) -> float:
        return max(self.until, self.held)


class Throttle:
    """Failed checks per key of one kind, each key's delay; bounded (see the module)."""

    def __init__(self, policy: ThrottlePolicy | None = None) -> None:
        self.policy = policy or ThrottlePolicy()
        # In order of last failure, oldest first: forgotten keys form a prefix, and the
        # least recent is the one to evict.
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def _live(self, key: str, now: float) -> _Record | None:
        record = self._records.get(key)
        if record is not None and now - record.last >= self.policy.forget and record.free_at() <= now:
            del self._records[key]
            return None
        return record

    def failures(self, key: str, now: float) -> int:
        """Failures ``key`` has made in a row (not yet forgotten)."""
        record = self._live(key, now)
        return 0 if record is None else record.failures

    def wait(self, key: str, now: float) -> float:
        """Seconds before a password of ``key`` may be checked; 0: it may be now."""
        record = self._live(key, now)
        return 0.0 if record is None else max(0.0, record.free_at() - now)

    def begin(self, key: str, now: float) -> bool:
        """A check of ``key`` starts (when :meth:`wait` is 0). If the key is throttled,
        no other check of it may start until this one's outcome (or, should that never
        come, for ``cap`` seconds); returns whether it holds the key so, to be passed to
        :meth:`failed` or :meth:`release`."""
        record = self._live(key, now)
        if record is None or record.failures < self.policy.free:
            return False
        record.held = now + self.policy.cap
        return True

    def failed(self, key: str, now: float, held: bool = False) -> float:
        """Count a failure of ``key`` (``held``: as :meth:`begin` returned for its check);
        returns the delay the key is now shut out for."""
        record = self._live(key, now)
        if record is None:
            self._make_room(now)
            record = self._records[key] = _Record()
        else:
            self._records.move_to_end(key)
            if held:
                record.held = 0.0
        record.failures += 1
        record.last = now
        delay = self.policy.delay(record.failures)
        record.until = now + delay
        return delay

    def release(self, key: str, held: bool) -> None:
        """A check of ``key`` ended without a failure (it passed, or was abandoned):
        its hold, if it had one, ends; the key's failures stay."""
        record = self._records.get(key)
        if held and record is not None:
            record.held = 0.0

    def forgive(self, key: str) -> None:
        """Forget ``key``'s failures (its owner has proven the password)."""
        self._records.pop(key, None)

    def _make_room(self, now: float) -> None:
        records = self._records
        forget = self.policy.forget
        # Forgotten keys first: amortized, each key is dropped at most once.
        while records:
            oldest = next(iter(records.values()))
            if now - oldest.last < forget or oldest.free_at() > now:
                break
            records.popitem(last=False)
        while len(records) >= self.policy.max_keys:
            records.popitem(last=False)

    def delayed(self, now: float) -> tuple[int, float]:
        """How many keys are shut out now, and the longest remaining delay (O(keys))."""
        count, longest = 0, 0.0
        for record in self._records.values():
            remaining = record.free_at() - now
            if remaining > 0:
                count += 1
                longest = max(longest, remaining)
        return count, longest


def source_key(host: str) -> str:
    """The key a source address is throttled under: an IPv4 address as itself (an
    IPv4-mapped IPv6 one too), an IPv6 address by its /64, the smallest block a
    single subscriber is usually given; anything unparsable as it is."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Admission(enum.Enum):
    """What to do with a CONNECT's credentials (see :meth:`AuthGate.admit`)."""

    ACCEPT = "accept"
    """Verified before, and its source is not throttled: accept without hashing."""
    CHECK = "check"
    """Check the password (call :meth:`AuthGate.begin`, then :meth:`AuthGate.outcome`)."""
    REFUSE_SOURCE = "refuse-source"
    """Its source address is throttled: refuse, unchecked."""
    REFUSE_USER = "refuse-user"
    """Its username is throttled and the credentials were not verified before: refuse,
    unchecked (counted as a failure of the source)."""


class AuthGate:
    """The throttling policy for CONNECT credentials: per source address and per username."""

    def __init__(self, policy: ThrottlePolicy | None = None) -> None:
        self.policy = policy or ThrottlePolicy()
        self.sources = Throttle(self.policy)
        self.users = Throttle(self.policy)

    def admit(self, source: str, username: str, now: float, *, known_good: bool) -> Admission:
        """Whether to accept, check or refuse credentials from ``source`` for ``username``;
        ``known_good``: the server verified exactly these credentials before (its cache).

        The source's delay applies to every attempt from it, known-good ones included:
        otherwise a throttled address could test guesses against the cache at full
        speed. A username's delay does not apply to known-good credentials, so an
        attacker hammering a device's username from elsewhere cannot lock the device out
        once it has connected; other attempts for that username are refused unchecked
        while its delay runs, and each counts as a failure of its source, so cycling
        through guesses that way is throttled by address too.
        """
        if self.sources.wait(source, now) > 0:
            return Admission.REFUSE_SOURCE
        if known_good:
            return Admission.ACCEPT
        if self.users.wait(username, now) > 0:
            self.sources.failed(source, now)
            return Admission.REFUSE_USER
        return Admission.CHECK

    def begin(self, source: str, username: str, now: float) -> Hold:
        """A password check admitted by :meth:`admit` starts (called at the moment it
        does); pass what it returns to :meth:`outcome` or :meth:`abandon`."""
        return Hold(self.sources.begin(source, now), self.users.begin(username, now))

    def outcome(self, source: str, username: str, now: float, accepted: bool, hold: Hold) -> None:
        """A check ended. A failure counts against both keys; a success forgives the
        username (its owner proved the password) but not the source, or one valid
        account would reset an address's count between guesses at others."""
        if accepted:
            self.sources.release(source, hold.source)
            self.users.forgive(username)
        else:
            self.sources.failed(source, now, hold.source)
            self.users.failed(username, now, hold.user)

    def abandon(self, source: str, username: str, hold: Hold) -> None:
        """A check that began will have no outcome (cancelled): release its holds."""
        self.sources.release(source, hold.source)
        self.users.release(username, hold.user)


@dataclass(frozen=True)
class Hold:
    """Which keys a check under way holds (see :meth:`Throttle.begin`)."""

    source: bool
    user: bool
