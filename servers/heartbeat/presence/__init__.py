"""Presence, pure: the event that says a device came online or went offline, and why
(:mod:`.event`, with its JSON-lines log), and the counts and searches an operator
reads (:mod:`.overview`).

May import: :mod:`..mqtt`. The coordinators decide when events happen; this says what
one is. ``PresenceEvent``, ``Offline`` and the sinks are importable from here.
"""

from ..mqtt.endings import Offline
from .event import OFFLINE, ONLINE, REFUSED, PresenceEvent, PresenceLog, PresenceSink

__all__ = ["OFFLINE", "ONLINE", "REFUSED", "Offline", "PresenceEvent", "PresenceLog", "PresenceSink"]
