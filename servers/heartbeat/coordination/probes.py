"""The authority's barrier: probes to every other worker, whose answers say each has
applied whatever the authority sent it before them.

Links deliver in order, so once a worker answers a :class:`~.frames.Probe`, it has
applied every frame sent to it before: a subscription's filters (a SUBACK waits for
that), or the end of a session it held (a reconnect elsewhere waits for that).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ...bus import Link
from . import frames

__all__ = ["Probes"]


class _Linked(Protocol):
    @property
    def link(self) -> Link: ...

    @property
    def worker(self) -> int: ...


P = TypeVar("P", bound=_Linked)


@dataclass
class _Settling(Generic[P]):
    """Probes out: the links whose :class:`Probed` is awaited, and what to do then (answer
    a :class:`Settle`, or an :class:`OpenSession` that had to wait)."""

    requester: int
    waiting: set[int]
    then: Callable[[P], None]


class Probes(Generic[P]):
    """The probes out to the workers of ``peers`` (by link number; the authority's own dict)."""

    def __init__(self, peers: Mapping[int, P]) -> None:
        self._peers = peers
        self._settling: dict[int, _Settling[P]] = {}  # by probe token
        self._tokens = itertools.count(1)

    def probe(self, peer: P, then: Callable[[P], None]) -> None:
        """Probe every worker but ``peer``'s; ``then(peer)`` once all have answered."""
        others = [p for p in self._peers.values() if p is not peer and p.worker >= 0]
        token = next(self._tokens)
        self._settling[token] = _Settling(peer.link.number, {p.link.number for p in others}, then)
        if not others:
            self._settled(token)
            return
        line = frames.encode(frames.Probe(token))
        for other in others:
            other.link.send(line)

    def answered(self, token: int, number: int) -> None:
        """Link ``number`` answered probe ``token``."""
        settling = self._settling.get(token)
        if settling is not None:
            settling.waiting.discard(number)
            if not settling.waiting:
                self._settled(token)

    def gone(self, number: int) -> None:
        """Link ``number`` is gone: its own questions are dropped, and it answers the
        others' (a gone worker routes nothing)."""
        for token, settling in list(self._settling.items()):
            if settling.requester == number:
                del self._settling[token]
            else:
                self.answered(token, number)

    def _settled(self, token: int) -> None:
        settling = self._settling.pop(token)
        requester = self._peers.get(settling.requester)
        if requester is not None:
            settling.then(requester)
