"""How the authority spreads a message over the workers: to every worker with a
matching subscriber, and to one worker in turn for each shared subscription."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

from ...bus import Link
from ..broker.topics import FilterIndex
from . import frames

__all__ = ["Spread"]


class _Linked(Protocol):
    @property
    def link(self) -> Link: ...

    @property
    def index(self) -> FilterIndex: ...


P = TypeVar("P", bound=_Linked)


class Spread(Generic[P]):
    """Deliveries to the workers of ``peers`` (by link number; the authority's own dict)."""

    def __init__(self, peers: Mapping[int, P]) -> None:
        self._peers = peers
        self._turns: dict[str, int] = {}
        """Whose turn it is, per shared subscription held on several workers."""
        self.shared_lost = 0
        """Shared subscriptions' unacknowledged messages passed on with no member left to take them."""

    def deliver(self, frame: frames.Deliver, skip: P | None = None) -> None:
        """``frame`` to every worker with a matching subscriber but ``skip`` (the one that
        published it); and, for each shared subscription the topic reaches, to one of
        the workers holding it, in turn (not at all if only ``skip`` holds it: it served
        it itself)."""
        line = b""
        topic = frame.message.topic
        holders: dict[str, list[P]] = {}
        for peer in list(self._peers.values()):
            index = peer.index
            if not index:
                continue
            if peer is not skip and index.matches_plain(topic):
                line = line or frames.encode(frame)
                peer.link.send(line)
            if index.shared:
                for group in index.shared.matching(topic):
                    holders.setdefault(group, []).append(peer)
        for group, peers in holders.items():
            if peers == [skip]:
                continue
            self._next(group, peers).link.send(frames.encode(replace(frame, group=group)))

    def pass_on(self, frame: frames.Deliver, skip: P) -> None:
        """A shared subscription's message a member of ``skip`` left unacknowledged: to
        another worker holding the group, in turn (lost if none does now, counted)."""
        topic = frame.message.topic
        peers = [
            p
            for p in list(self._peers.values())
            if p is not skip and p.index and p.index.shared and frame.group in p.index.shared.matching(topic)
        ]
        if not peers:
            self.shared_lost += 1
            return
        self._next(frame.group, peers).link.send(frames.encode(frame))

    def _next(self, group: str, peers: list[P]) -> P:
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        return peers[turn % len(peers)]
