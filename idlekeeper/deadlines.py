"""One connection's deadlines and activity stamps, and the rule that resolves them.

Pure: no trio, no I/O; the time is passed in. The keeper files each connection once
in its wheel, at :meth:`ConnectionDeadlines.check_time`. Activity only stores an
epoch stamp (``rx`` / ``tx``) and so only ever moves a true deadline *later*; the
filed time therefore stays at or before the true one, and when it comes due the
keeper calls :meth:`~ConnectionDeadlines.resolve` to either expire the connection
or file it again (Netty's IdleStateHandler and EMQX work the same way).
"""

from __future__ import annotations

import enum
import math

from .epochs import NEVER, Epoch, Stamp, latest
from .wheel import WheelEntry

__all__ = ["ConnectionDeadlines", "Reason"]

_INF = math.inf
# One shared object: ``-_INF`` written in __init__ would make a new float (24 bytes)
# for each of three fields of every connection.
_NEG_INF = -math.inf


class Reason(str, enum.Enum):
    """Why a watched connection was expired."""

    IDLE = "idle"
    """No activity in either direction for ``idle_timeout``."""
    RECEIVE = "receive"
    """Nothing received for ``receive_timeout``."""
    SEND = "send"
    """A send made no progress for ``send_timeout`` (the peer stopped reading)."""
    ABSOLUTE = "absolute"
    """The absolute ``deadline`` passed."""

    def __str__(self) -> str:
        return self.value


def _check_timeout(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not value > 0 or math.isnan(value):
        raise ValueError(f"{name} must be a positive number of seconds or None, not {value!r}")
    if math.isinf(value):
        return None
    # An int or a float is kept as it is: float(30) would be a new object, 24 bytes,
    # on every connection its timeout is set on.
    return value if type(value) is int or type(value) is float else float(value)


class ConnectionDeadlines(WheelEntry):
    """Idle, receive, send and absolute deadlines of one connection.

    Stamps: ``rx`` is the epoch of the last receive, ``tx`` of the last send progress;
    ``sending`` is true while a send is pending. Each timeout counts from the later
    of its last activity and the moment it was set, so setting a timeout when a
    protocol changes phase means "from now". That moment is a stamp too: a time, or
    the epoch it was set in, which like any stamp can make an expiry late by the
    length of that loop pass, never early.
    """

    __slots__ = (
        "_rx",
        "_tx",
        "_sending",
        "_idle",
        "_receive",
        "_send",
        "_deadline",
        "_idle_since",
        "_receive_since",
        "_send_since",
    )

    def __init__(self) -> None:
        super().__init__()
        self._rx: Stamp = NEVER
        self._tx: Epoch = NEVER
        self._sending = False
        self._idle: float | None = None
        self._receive: float | None = None
        self._send: float | None = None
        self._deadline = _INF
        # When each timeout was set, stamped as activity is (usually the epoch then
        # current, which costs no object): a float a connection would be 24 bytes.
        self._idle_since: Stamp = _NEG_INF
        self._receive_since: Stamp = _NEG_INF
        self._send_since: Stamp = _NEG_INF

    # -- configuration (the time of the change is passed in) -------------------

    @property
    def idle_timeout(self) -> float | None:
        """Seconds without activity in either direction, or None."""
        return self._idle

    @property
    def receive_timeout(self) -> float | None:
        """Seconds without a receive, or None."""
        return self._receive

    @property
    def send_timeout(self) -> float | None:
        """Seconds a pending send may go without progress, or None."""
        return self._send

    @property
    def deadline(self) -> float:
        """Absolute time by which the connection ends, ``inf`` for none."""
        return self._deadline

    def _set_idle_timeout(self, seconds: float | None, since: Stamp) -> None:
        """Set (or with None clear) the idle timeout, counting from ``since``."""
        self._idle = _check_timeout("idle timeout", seconds)
        self._idle_since = since

    def _set_receive_timeout(self, seconds: float | None, since: Stamp) -> None:
        """Set (or with None clear) the receive timeout, counting from ``since``."""
        self._receive = _check_timeout("receive timeout", seconds)
        self._receive_since = since

    def _set_send_timeout(self, seconds: float | None, since: Stamp) -> None:
        """Set (or with None clear) the send timeout, counting from ``since``."""
        self._send = _check_timeout("send timeout", seconds)
        self._send_since = since

    def _set_deadline(self, when: float | None) -> None:
        """Set the absolute deadline (``None`` or ``inf`` clears it)."""
        if when is None:
            when = _INF
        if math.isnan(when):
            raise ValueError("deadline must not be NaN")
        self._deadline = when

    @property
    def has_deadline(self) -> bool:
        """Whether any deadline is set."""
        return not (self._idle is None and self._receive is None and self._send is None and self._deadline == _INF)

    # -- resolution ------------------------------------------------------------

    def resolve(self, now: float) -> tuple[float, Reason | None]:
        """The earliest deadline that applies now and its reason; ``(inf, None)`` if none.

        Uses the latest possible time of each stamped activity, so a deadline it
        reports is never earlier than the true one.
        """
        when = self._deadline
        reason: Reason | None = Reason.ABSOLUTE if when != _INF else None
        if self._send is not None and self._sending:
            t = max(latest(self._send_since, now), latest(self._tx, now)) + self._send
            if t < when:
                when, reason = t, Reason.SEND
        if self._receive is not None or self._idle is not None:
            rx = latest(self._rx, now)
            if self._receive is not None:
                t = max(latest(self._receive_since, now), rx) + self._receive
                if t < when:
                    when, reason = t, Reason.RECEIVE
            if self._idle is not None:
                t = max(latest(self._idle_since, now), rx, latest(self._tx, now)) + self._idle
                if t < when:
                    when, reason = t, Reason.IDLE
        return when, reason

    def check_time(self, now: float, resolved: float | None = None) -> float:
        """When the keeper must look at this connection next; ``inf`` for never.

        The earliest resolved deadline (pass it as ``resolved`` if already known),
        or sooner: a send that is not pending yet could start at any moment after
        ``now`` and so end no sooner than ``now + send_timeout``, which is when it
        is worth checking again. This lets ``send_all`` flip ``sending`` with a
        plain store and no wheel operation.
        """
        when = self.resolve(now)[0] if resolved is None else resolved
        if self._send is not None and not self._sending:
            t = max(latest(self._send_since, now), latest(self._tx, now), now) + self._send
            if t < when:
                when = t
        return when
