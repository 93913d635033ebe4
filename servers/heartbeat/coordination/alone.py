"""A supervised worker whose supervisor is gone: it publishes its own sessions' events.

Until the kernel's parent-death signal stops it, the worker keeps a registry of its
own and publishes each start and end once, to its sinks and its subscribers, so a
device's offline event is not lost with the supervisor. Not when the box keeps its
state durably: the box's record tells those ends, once, at its next start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..presence.event import PresenceEvent, PresenceSink
from . import Host, frames, publish_to_sinks
from .registry import Registry
from .retention import live_presence, presence_properties

__all__ = ["Alone"]


class Alone:
    """The registry and the publishing of a worker left alone (see the module's docstring)."""

    def __init__(
        self, sinks: Sequence[PresenceSink], host: Callable[[], Host | None], presence_prefix: str, durable: bool
    ) -> None:
        self.registry = Registry()
        self._sinks = sinks
        self._host = host
        self._prefix = presence_prefix
        self._durable = durable

    def apply(self, frame: frames.Claimed | frames.Ended) -> None:
        """A session's start or end that the supervisor did not acknowledge, or that came after it left."""
        if self._durable:
            return
        registry = self.registry
        emit: list[PresenceEvent]
        if isinstance(frame, frames.Claimed):
            emit = registry.online(frame.event).emit
        else:
            one = registry.offline(frame.event, forget=frame.forget)
            emit = [] if one is None else [one]
        host = self._host()
        for event in emit:
            publish_to_sinks(self._sinks, event)
            if host is not None and event.client_id is not None:
                # The supervisor's offline TTL is not known here: no Message Expiry.
                properties = presence_properties(event, None, 0.0)
                host.deliver(live_presence(self._prefix + event.client_id, event, properties))
