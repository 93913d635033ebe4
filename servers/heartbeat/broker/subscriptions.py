"""Subscriptions, pure: which subscriber keys want a message on a topic, at which QoS.

:func:`~..mqtt.filters.topic_matches` states MQTT's rules (4.7); this is how they are
applied at scale. Exact filters (no wildcards) sit in a dict, so a device subscribed to
its own command topic costs O(1) per publish however many devices there are; wildcard
filters sit in a tree of levels (:mod:`.topics`), so a publish costs a step per level
of its topic and per filter it matches, however many wildcard filters one client holds.
Shared subscriptions (``$share/<group>/<filter>``) are kept by group, apart.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any, Generic, TypeVar

from ..mqtt.filters import NO_LOCAL, RETAIN_AS_PUBLISHED, SHARE_PREFIX, is_wildcard, topic_matches
from ..mqtt.policy import utf8_length
from ..mqtt.v5.outbound import subscription_identifier
from .topics import FilterChanges, SharedFilters, TopicTree

__all__ = ["Subscriptions"]


K = TypeVar("K", bound=Hashable)


_ROUTE_MEMO = 4096
"""Subscribers (plus one a topic) that :meth:`Subscriptions.route` keeps found: a
topic per device (its presence, its telemetry) must not make it a table per device."""
_NOBODY: dict[Any, int] = {}
"""The route of every topic nobody wants (one table, never remembered)."""


class Subscriptions(Generic[K]):
    """Topic filters per subscriber key, with the granted QoS of each, at most ``max_qos``.

    A shared subscription (``$share/<group>/<filter>``, MQTT 5) joins its group: its
    members are kept apart from the other subscriptions (:meth:`route` never returns
    them), and each message for the group goes to one of them (:meth:`members`)."""

    def __init__(self, max_qos: int) -> None:
        self._max_qos = max_qos
        self._groups: dict[str, dict[K, int]] = {}
        """Each shared subscription's members (by its whole filter), in the order they joined."""
        self._shared = SharedFilters()
        self._turns: dict[str, int] = {}
        """Where each group's next message starts looking for a member (round robin)."""
        self._exact: dict[str, dict[K, int]] = {}
        self._wild: dict[str, dict[K, int]] = {}
        self._tree: TopicTree[dict[K, int]] = TopicTree()
        """The dicts of ``_wild`` by their filters' levels, for :meth:`route`."""
        self._by_key: dict[K, set[str]] = {}
        self._bytes: dict[K, int] = {}
        """The bytes of each key's filters, for the per-client bound: a SUBSCRIBE must not
        cost a step per filter its client already holds."""
        self._options: dict[K, dict[str, int]] = {}
        """MQTT 5 subscription options (:func:`pack_options`) of the filters that have any:
        most subscriptions have none, and the common delivery never looks here."""
        self._changes: FilterChanges | None = None
        # Each topic's subscribers as route() found them, until the subscriptions
        # change: publishers send to the same topics again and again, and the walk of
        # the filter tree was a tenth of a forwarded message's work. Bounded in
        # subscribers counted over all topics; emptied when full, and on any change.
        self._routes: dict[str, dict[K, int]] = {}
        self._routed = 0

    def __len__(self) -> int:
        return sum(len(filters) for filters in self._by_key.values())

    def shared_count(self) -> int:
        """Shared subscriptions held, a member's each (a step per group)."""
        return sum(len(members) for members in self._groups.values())

    def subscribe(self, key: K, topic_filter: str, qos: int, options: int = 0) -> int:
        """Add or replace a subscription, with its MQTT 5 ``options`` (:func:`pack_options`;
        0: none); returns the granted QoS (capped)."""
        if options:
            self._options.setdefault(key, {})[topic_filter] = options
        else:
            self._drop_option(key, topic_filter)
        granted = min(qos, self._max_qos)
        if topic_filter.startswith(SHARE_PREFIX):
            subs = self._groups.get(topic_filter)
            if subs is None:
                subs = self._groups[topic_filter] = {}
                self._shared.add(topic_filter)
                if self._changes is not None:
                    self._changes.came(topic_filter)
        else:
            wild = is_wildcard(topic_filter)
            table = self._wild if wild else self._exact
            subs = table.get(topic_filter)
            if subs is None:
                subs = table[topic_filter] = {}
                if wild:
                    self._tree.set(topic_filter, subs)
                if self._changes is not None:
                    self._changes.came(topic_filter)
            self._forget_routes()
        subs[key] = granted
        held = self._by_key.setdefault(key, set())
        if topic_filter not in held:
            held.add(topic_filter)
            self._bytes[key] = self._bytes.get(key, 0) + utf8_length(topic_filter)
        return granted

    def unsubscribe(self, key: K, topic_filter: str) -> bool:
        """Remove one subscription; returns whether it existed."""
        if topic_filter.startswith(SHARE_PREFIX):
            return self._leave(key, topic_filter)
        wild = is_wildcard(topic_filter)
        table = self._wild if wild else self._exact
        subs = table.get(topic_filter)
        if not subs or key not in subs:
            return False
        del subs[key]
        self._forget_routes()
        if not subs:
            del table[topic_filter]
            if wild:
                self._tree.pop(topic_filter)
            if self._changes is not None:
                self._changes.went(topic_filter)
        self._forget_filter(key, topic_filter)
        return True

    def _leave(self, key: K, topic_filter: str) -> bool:
        members = self._groups.get(topic_filter)
        if not members or key not in members:
            return False
        del members[key]
        if not members:
            del self._groups[topic_filter]
            self._turns.pop(topic_filter, None)
            self._shared.discard(topic_filter)
            if self._changes is not None:
                self._changes.went(topic_filter)
        self._forget_filter(key, topic_filter)
        return True

    def _drop_option(self, key: K, topic_filter: str) -> None:
        held_options = self._options.get(key)
        if held_options is not None and held_options.pop(topic_filter, None) is not None and not held_options:
            del self._options[key]

    def _forget_filter(self, key: K, topic_filter: str) -> None:
        self._drop_option(key, topic_filter)
        filters = self._by_key.get(key)
        if filters is not None:
            filters.discard(topic_filter)
            if filters:
                self._bytes[key] -= utf8_length(topic_filter)
            else:
                del self._by_key[key]
                del self._bytes[key]

    def drop(self, key: K) -> None:
        """Remove every subscription of ``key`` (its connection ended)."""
        for topic_filter in list(self._by_key.get(key, ())):
            self.unsubscribe(key, topic_filter)

    def filters(self) -> set[str]:
        """Every filter that has at least one subscriber (shared subscriptions' whole)."""
        return set(self._exact) | set(self._wild) | set(self._groups)

    @property
    def has_groups(self) -> bool:
        """Whether any shared subscription is held here."""
        return bool(self._groups)

    def groups(self, topic: str) -> list[str]:
        """The shared subscriptions held here that ``topic`` reaches (their whole filters)."""
        return self._shared.matching(topic) if self._shared else []

    def members(self, shared: str) -> dict[K, int]:
        """A shared subscription's members here, with their granted QoS (a view)."""
        return self._groups.get(shared, {})

    def turn(self, shared: str) -> int:
        """Where the group's next message starts looking (and moves it on by one)."""
        turn = self._turns.get(shared, 0)
        self._turns[shared] = turn + 1
        return turn

    def track(self) -> FilterChanges:
        """Record, from now on, each filter that gains its first subscriber or loses its
        last; the record starts with every filter held now as come. It has one reader (a
        second call returns the same record), who takes from it: untaken, it holds an
        entry per filter held."""
        if self._changes is None:
            self._changes = FilterChanges()
            for topic_filter in (*self._exact, *self._wild, *self._groups):
                self._changes.came(topic_filter)
        return self._changes

    def has(self, key: K) -> bool:
        """Whether ``key`` has any subscription."""
        return key in self._by_key

    def held(self, key: K) -> Collection[str]:
        """The filters ``key`` holds (a view: read it, do not keep it)."""
        return self._by_key.get(key, ())

    def options(self, key: K) -> dict[str, int] | None:
        """The MQTT 5 options of ``key``'s filters that have any (a view), or None."""
        return self._options.get(key)

    def shaped(
        self, key: K, options: dict[str, int], topic: str, own: bool, published_retain: bool, shared: str = ""
    ) -> tuple[bool, bytes] | None:
        """What the MQTT 5 options of ``key``'s filters matching ``topic`` (``options``, as
        :meth:`options` gives them) make of a message: the retain flag (Retain As
        Published) and the Subscription Identifiers to add; None if No Local skips it
        (``own``: ``key`` published it, and every filter of ``key`` that matches says
        No Local). ``shared``: a shared subscription's copy, shaped by its options alone."""
        if shared:  # a shared subscription's copy: its own options only
            matched = [options[shared]] if shared in options else []
        else:
            matched = [
                value
                for topic_filter, value in options.items()
                if not topic_filter.startswith(SHARE_PREFIX) and topic_matches(topic_filter, topic)
            ]
        if not matched:
            return False, b""
        if own and all(value & NO_LOCAL for value in matched):
            others = (f for f in self.held(key) if f not in options)
            if not any(topic_matches(f, topic) for f in others):
                return None
        flag = published_retain and any(value & RETAIN_AS_PUBLISHED for value in matched)
        ids = sorted({value >> 2 for value in matched if value >> 2})
        return flag, b"".join(subscription_identifier(i) for i in ids)

    def held_bytes(self, key: K) -> int:
        """The bytes of filter text ``key`` holds (kept as it changes, not summed per call)."""
        return self._bytes.get(key, 0)

    def route(self, topic: str) -> dict[K, int]:
        """Subscribers of ``topic`` with the QoS to deliver at (the highest match wins).

        The dict is shared with later calls until the subscriptions change: read it,
        do not change it."""
        out = self._routes.get(topic)
        if out is not None:
            return out
        out = dict(self._exact.get(topic, {}))
        for subs in self._tree.match(topic):
            for key, qos in subs.items():
                if qos > out.get(key, -1):
                    out[key] = qos
        if not out:
            # Not remembered: a topic nobody wants is most often one of a device's own
            # (its presence, its telemetry), seen once or twice a session, and a memo of
            # them would hold a topic string per device for nothing.
            return _NOBODY
        self._routed += len(out) + 1
        if self._routed > _ROUTE_MEMO:
            self._forget_routes()
            self._routed = len(out) + 1
        self._routes[topic] = out
        return out

    def _forget_routes(self) -> None:
        if self._routes:
            self._routes.clear()
            self._routed = 0
