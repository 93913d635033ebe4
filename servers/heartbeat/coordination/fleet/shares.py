"""Shared subscriptions across the fleet: which node serves each message of a group.

A shared subscription (``$share/<group>/<filter>``, MQTT 5) gets each message once,
fleet-wide, at one member. Every node publishes its filters (shared ones whole), so
each node knows which nodes hold a group:

- a device's message is placed by the node it arrived on: the nodes holding the
  group take turns (:meth:`SharePicker.pick`), and the pick rides on that node's
  route entry;
- a presence event reaches every node from the presence stream, with nobody to pick:
  each node works out the same owner from the event itself, a hash of its session
  and status over the sorted holders (:meth:`SharePicker.owned`), so exactly one
  node serves it while the nodes agree on who holds the group (a node joining or
  leaving a group can, for an instant, make one event go to two nodes or none).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence

from ...broker.topics import FilterIndex, SharedFilters

__all__ = ["SharePicker"]


class SharePicker:
    """Picks the node that serves a shared subscription's message (see the module docs).

    ``remote`` is the coordinator's view of the other nodes' filters (changed in place)."""

    def __init__(self, node: str, remote: dict[str, FilterIndex]) -> None:
        self.node = node
        self.remote = remote
        self.own = SharedFilters()
        """The shared subscriptions held on this node."""
        self._turns: dict[str, int] = {}

    def changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        """This node's subscribers came to hold ``added`` and let go of ``removed`` (the
        index keeps only the shared ones, and takes a repeat as no change)."""
        for topic_filter in removed:
            self.own.discard(topic_filter)
        for topic_filter in added:
            self.own.add(topic_filter)

    def _holders(self, topic: str, here: Sequence[str]) -> dict[str, list[str]]:
        holders: dict[str, list[str]] = {group: [self.node] for group in here}
        for node, index in self.remote.items():
            if node != self.node and index.shared:
                for group in index.shared.matching(topic):
                    holders.setdefault(group, []).append(node)
        return holders

    def pick(self, topic: str, here: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
        """For a message published on this node: the shared subscriptions held ``here``
        that this node serves, and the others by the node picked for each."""
        mine: list[str] = []
        elsewhere: dict[str, list[str]] = {}
        for group, nodes in self._holders(topic, here).items():
            if nodes == [self.node]:
                mine.append(group)
                continue
            nodes.sort()
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            chosen = nodes[turn % len(nodes)]
            if chosen == self.node:
                mine.append(group)
            else:
                elsewhere.setdefault(chosen, []).append(group)
        return mine, elsewhere

    def elsewhere(self, topic: str, group: str) -> str | None:
        """Another node holding shared subscription ``group`` (which ``topic`` reaches),
        in turn; None if no other node holds it."""
        nodes = sorted(
            node
            for node, index in self.remote.items()
            if node != self.node and index.shared and group in index.shared.matching(topic)
        )
        if not nodes:
            return None
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        return nodes[turn % len(nodes)]

    def owned(self, topic: str, key: str) -> list[str]:
        """The shared subscriptions held here that this node serves a fleet-wide event
        (``key`` names it the same on every node) to."""
        here = self.own.matching(topic) if self.own else []
        if not here:
            return []
        mine = []
        for group, nodes in self._holders(topic, here).items():
            nodes.sort()
            if nodes[zlib.crc32(f"{group}\0{key}".encode()) % len(nodes)] == self.node:
                mine.append(group)
        return mine
