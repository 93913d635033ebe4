"""Topic filters in a tree of levels: which filters match a topic, in time that grows
with the topic's depth and the filters that match, not with how many filters there are.

Pure (no I/O). A filter's levels are the path from the root to its node; each node
has a dict of literal children, a ``+`` child and a ``#`` child of its own, so a
topic is matched by following, level by level, the literal child named like the
level and the ``+`` child, and taking every ``#`` child met on the way. The rules
are MQTT's (4.7), as :func:`servers.heartbeat.mqtt.filters.topic_matches` states them:

- ``+`` matches exactly one level (an empty one too: ``a/+`` matches ``a/``);
- ``#`` matches its own level and every level below, so ``a/#`` matches ``a``;
- a topic starting with ``$`` is not matched by a filter starting with a wildcard
  (MQTT-4.7.2-1): the root's ``+`` and ``#`` children are skipped for it;
- a level holding ``+`` or ``#`` among other characters is literal, as the reference
  treats it, and whatever follows a ``#`` level is matched by that ``#`` (the reader
  refuses both kinds of filter, so neither reaches here from a client).

Topics are matched as publishes carry them: without wildcards. A node exists per
distinct level prefix of the filters held and goes when its last filter does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set
from typing import Generic, TypeVar

from ..mqtt.filters import SHARE_PREFIX, is_wildcard, shared_filter

__all__ = ["SHARE_PREFIX", "FilterChanges", "FilterIndex", "SharedFilters", "TopicTree"]

V = TypeVar("V")

_PLUS, _HASH = "+", "#"


class _Node(Generic[V]):
    """One level of the filters that share the levels above it."""

    # A leaf is the common node (a filter's last level): it pays for four slots and
    # nothing else, its dict of children made only when a level goes below it.
    __slots__ = ("children", "plus", "hash", "value")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] | None = None
        self.plus: _Node[V] | None = None
        self.hash: _Node[V] | None = None
        self.value: V | None = None

    def empty(self) -> bool:
        return self.value is None and not self.children and self.plus is None and self.hash is None


class TopicTree(Generic[V]):
    """A map from topic filters to values (never None), matched against topics.

    :meth:`match` costs a dict lookup or two per topic level and per filter prefix the
    topic still matches, plus one step per filter matched: the filters that share no
    prefix with the topic cost nothing.
    """

    __slots__ = ("_root", "_count")

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, topic_filter: object) -> bool:
        return isinstance(topic_filter, str) and self.get(topic_filter) is not None

    def get(self, topic_filter: str) -> V | None:
        """The value held for ``topic_filter``, or None."""
        node = self._find(topic_filter, None)
        return None if node is None else node.value

    def _find(self, topic_filter: str, path: list[tuple[_Node[V], str]] | None) -> _Node[V] | None:
        """The node of ``topic_filter`` (None: no filter has its levels), noting each
        (parent, level) on the way in ``path`` if given."""
        node: _Node[V] | None = self._root
        for level in topic_filter.split("/"):
            assert node is not None
            if path is not None:
                path.append((node, level))
            if level == _PLUS:
                node = node.plus
            elif level == _HASH:
                node = node.hash
            else:
                node = node.children.get(level) if node.children else None
            if node is None:
                return None
        return node

    def set(self, topic_filter: str, value: V) -> None:
        """Hold ``value`` for ``topic_filter`` (replacing any)."""
        if value is None:
            raise ValueError("a TopicTree holds no None values: pop the filter instead")
        node = self._root
        for level in topic_filter.split("/"):
            if level == _PLUS:
                child = node.plus
                if child is None:
                    child = node.plus = _Node()
            elif level == _HASH:
                child = node.hash
                if child is None:
                    child = node.hash = _Node()
            else:
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(level)
                if child is None:
                    child = children[level] = _Node()
            node = child
        if node.value is None:
            self._count += 1
        node.value = value

    def pop(self, topic_filter: str) -> V | None:
        """Stop holding ``topic_filter``; its value, or None if it was not held. Nodes
        left with no filter at or below them go."""
        path: list[tuple[_Node[V], str]] = []
        node = self._find(topic_filter, path)
        if node is None or node.value is None:
            return None
        value = node.value
        node.value = None
        self._count -= 1
        while path and node.empty():
            parent, level = path.pop()
            if level == _PLUS:
                parent.plus = None
            elif level == _HASH:
                parent.hash = None
            else:
                assert parent.children is not None
                del parent.children[level]
                if not parent.children:
                    parent.children = None
            node = parent
        return value

    def match(self, topic: str) -> list[V]:
        """The values of every filter that matches ``topic``, each once."""
        out: list[V] = []
        if self._count:
            self._walk(topic, out, first=False)
        return out

    def matches(self, topic: str) -> bool:
        """Whether any filter matches ``topic`` (stops at the first)."""
        return bool(self._count) and self._walk(topic, [], first=True)

    def _walk(self, topic: str, out: list[V], *, first: bool) -> bool:
        levels = topic.split("/")
        root = self._root
        nodes: list[_Node[V]] = []
        if topic[:1] != "$":  # a filter starting with a wildcard does not see $-topics (MQTT-4.7.2-1)
            if root.hash is not None:
                _collect(root.hash, out)
                if first:
                    return True
            if root.plus is not None:
                nodes.append(root.plus)
        if root.children is not None:
            child = root.children.get(levels[0])
            if child is not None:
                nodes.append(child)
        for depth in range(1, len(levels)):
            if not nodes:
                return bool(out)
            level = levels[depth]
            below: list[_Node[V]] = []
            for node in nodes:
                if node.hash is not None:
                    _collect(node.hash, out)
                    if first:
                        return True
                if node.plus is not None:
                    below.append(node.plus)
                children = node.children
                if children is not None:
                    child = children.get(level)
                    if child is not None:
                        below.append(child)
            nodes = below
        for node in nodes:  # every level matched: the filters ending here, and `a/#` for `a`
            if node.value is not None:
                out.append(node.value)
            if node.hash is not None:
                _collect(node.hash, out)
            if first and out:
                return True
        return bool(out)

    def items(self) -> Iterator[tuple[str, V]]:
        """Every (filter, value) held, in no set order (rebuilds each filter's text)."""
        stack: list[tuple[_Node[V], str | None]] = [(self._root, None)]
        while stack:
            node, name = stack.pop()
            if node.value is not None and name is not None:
                yield name, node.value
            prefix = "" if name is None else name + "/"
            if node.children:
                stack += [(child, prefix + level) for level, child in node.children.items()]
            if node.plus is not None:
                stack.append((node.plus, prefix + _PLUS))
            if node.hash is not None:
                stack.append((node.hash, prefix + _HASH))

    def nodes(self) -> int:
        """How many nodes the tree holds, the root included (for tests and memory figures)."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += 1
            if node.children:
                stack += node.children.values()
            stack += [n for n in (node.plus, node.hash) if n is not None]
        return count


def _collect(node: _Node[V], out: list[V]) -> None:
    """Every value at or below a ``#`` node: a valid filter ends at its ``#``, so this is
    its one value; levels after a ``#`` (refused by the reader) are matched by it."""
    if node.value is not None:
        out.append(node.value)
    if node.children is None and node.plus is None and node.hash is None:
        return
    for child in (*(node.children or {}).values(), node.plus, node.hash):
        if child is not None:
            _collect(child, out)


class FilterIndex:
    """A set of topic filters that answers whether a topic matches any of them: exact
    filters in a set (one lookup), wildcards in a :class:`TopicTree`.

    Made for the sets other workers or nodes send: whole, :meth:`replace` takes the new
    set and changes only the filters that came or went, so an update costs two set
    differences (C speed) and tree work for what changed, never a rebuild per message;
    as changes, :meth:`update` costs only what changed.
    """

    __slots__ = ("exact", "wild", "shared", "_all")

    def __init__(self, filters: Iterable[str] = ()) -> None:
        self.exact: set[str] = set()
        self.wild: TopicTree[str] = TopicTree()
        self.shared = SharedFilters()
        """The shared subscriptions among them (``$share/...``), matched by their filter."""
        # The set last given whole (kept, not copied), or a set of our own once one
        # filter at a time is added or discarded.
        self._all: Set[str] = frozenset()
        self.replace(frozenset(filters))

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, topic_filter: object) -> bool:
        return topic_filter in self._all

    def __iter__(self) -> Iterator[str]:
        return iter(self._all)

    def add(self, topic_filter: str) -> None:
        """Hold ``topic_filter`` too."""
        if topic_filter not in self._all:
            self._own().add(topic_filter)
            self._put(topic_filter)

    def discard(self, topic_filter: str) -> None:
        """Stop holding ``topic_filter`` (if held)."""
        if topic_filter in self._all:
            self._own().discard(topic_filter)
            self._take(topic_filter)

    def update(self, added: Iterable[str], removed: Iterable[str]) -> None:
        """Hold ``added`` too and stop holding ``removed`` (a change sent as such)."""
        for topic_filter in removed:
            self.discard(topic_filter)
        for topic_filter in added:
            self.add(topic_filter)

    def _own(self) -> set[str]:
        held = self._all
        if not isinstance(held, set):
            held = self._all = set(held)
        return held

    def replace(self, filters: Set[str]) -> None:
        """Hold exactly ``filters`` from now on."""
        new = filters if isinstance(filters, frozenset) else frozenset(filters)
        old = self._all
        if new is old:
            return
        for topic_filter in old - new:
            self._take(topic_filter)
        for topic_filter in new - old:
            self._put(topic_filter)
        self._all = new

    def matches(self, topic: str) -> bool:
        """Whether any filter held matches ``topic`` (a shared subscription's by its filter)."""
        return (
            topic in self.exact or self.wild.matches(topic) or (bool(self.shared) and bool(self.shared.matching(topic)))
        )

    def matches_plain(self, topic: str) -> bool:
        """Whether any filter held but the shared subscriptions' matches ``topic``."""
        return topic in self.exact or self.wild.matches(topic)

    def matching(self, topic: str) -> list[str]:
        """The filters held that match ``topic`` (shared ones whole, ``$share/...``)."""
        out = [topic] if topic in self.exact else []
        out += self.wild.match(topic)
        if self.shared:
            out += self.shared.matching(topic)
        return out

    def _put(self, topic_filter: str) -> None:
        if topic_filter.startswith(SHARE_PREFIX) and shared_filter(topic_filter) is not None:
            self.shared.add(topic_filter)
        elif is_wildcard(topic_filter):
            self.wild.set(topic_filter, topic_filter)
        else:
            self.exact.add(topic_filter)

    def _take(self, topic_filter: str) -> None:
        if topic_filter.startswith(SHARE_PREFIX) and shared_filter(topic_filter) is not None:
            self.shared.discard(topic_filter)
        elif is_wildcard(topic_filter):
            self.wild.pop(topic_filter)
        else:
            self.exact.discard(topic_filter)


class SharedFilters:
    """Shared subscriptions' filters (``$share/<group>/<filter>``), each matched by the
    filter after its group: which shared subscriptions a topic reaches."""

    __slots__ = ("_exact", "_wild")

    def __init__(self) -> None:
        self._exact: dict[str, set[str]] = {}
        self._wild: TopicTree[set[str]] = TopicTree()

    def __bool__(self) -> bool:
        return bool(self._exact) or bool(len(self._wild))

    def add(self, shared: str) -> None:
        """Hold ``shared`` (a ``$share/...`` filter; anything else is ignored)."""
        parts = shared_filter(shared)
        if parts is None:
            return
        inner = parts[1]
        if is_wildcard(inner):
            held = self._wild.get(inner)
            if held is None:
                held = set()
                self._wild.set(inner, held)
            held.add(shared)
        else:
            self._exact.setdefault(inner, set()).add(shared)

    def discard(self, shared: str) -> None:
        """Stop holding ``shared``."""
        parts = shared_filter(shared)
        if parts is None:
            return
        inner = parts[1]
        wild = is_wildcard(inner)
        held = self._wild.get(inner) if wild else self._exact.get(inner)
        if held is None:
            return
        held.discard(shared)
        if not held:
            if wild:
                self._wild.pop(inner)
            else:
                del self._exact[inner]

    def matching(self, topic: str) -> list[str]:
        """The shared subscriptions' filters (whole, ``$share/...``) that ``topic`` reaches."""
        out = list(self._exact.get(topic, ()))
        for held in self._wild.match(topic):
            out.extend(held)
        return out


class FilterChanges:
    """The filters that came into a set and went out of it since they were last taken.

    A filter that comes and goes again between two takes is no change at all, so what is
    taken is the difference between the set then and the set now, at a step per change
    rather than a comparison of the whole sets.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        # True: not in the set at the last take, in it now; False: the other way round.
        self._pending: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def came(self, topic_filter: str) -> None:
        """``topic_filter`` joined the set."""
        if self._pending.pop(topic_filter, True):
            self._pending[topic_filter] = True

    def went(self, topic_filter: str) -> None:
        """``topic_filter`` left the set."""
        if not self._pending.pop(topic_filter, False):
            self._pending[topic_filter] = False

    def take(self) -> tuple[frozenset[str], frozenset[str]]:
        """The filters that came and those that went since the last take; starts afresh."""
        pending, self._pending = self._pending, {}
        came = frozenset(f for f, joined in pending.items() if joined)
        return came, frozenset(pending.keys() - came)
