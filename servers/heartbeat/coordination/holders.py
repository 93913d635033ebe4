"""Who holds each topic filter among an authority's holders (its workers' links, and the
persistent sessions), and what each listening holder routes by: the filters held by
someone other than itself.

Pure (no I/O). A holder's view changes only when a filter's count of holders crosses
0 and 1 (everyone's view of it flips, or the one holder's), so a change costs a step,
plus a look at each listener when the count is that low: never a union of every set.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Set
from typing import Generic, TypeVar

from ..broker.topics import FilterChanges, FilterIndex

__all__ = ["Holders"]

H = TypeVar("H", bound=Hashable)


class Holders(Generic[H]):
    """Holders' filters, each holder's :class:`FilterIndex` kept here for matching, and
    the changes to the views of those that listen, until they are taken."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._held: dict[H, FilterIndex] = {}
        self._views: dict[H, FilterChanges] = {}
        """The listeners, with what changed in their views since they last were sent it."""
        self._dirty: set[H] = set()

    def index(self, holder: H) -> FilterIndex:
        """The filters ``holder`` holds (made empty on first use; read it, do not change it)."""
        held = self._held.get(holder)
        if held is None:
            held = self._held[holder] = FilterIndex()
        return held

    def listen(self, holder: H) -> frozenset[str]:
        """``holder`` routes by the others' filters from now on: the whole view to send
        it now; from here on :meth:`taken` gives it each change."""
        mine = self.index(holder)
        self._views[holder] = FilterChanges()
        self._dirty.discard(holder)
        return frozenset(f for f, count in self._count.items() if count > (f in mine))

    def view(self, holder: H) -> frozenset[str]:
        """The filters held by any holder but ``holder`` (O(filters): for checks and tests)."""
        mine = self._held.get(holder, ())
        return frozenset(f for f, count in self._count.items() if count > (f in mine))

    def change(self, holder: H, added: Iterable[str], removed: Iterable[str]) -> None:
        """``holder`` came to hold ``added`` and let go of ``removed`` (either may repeat
        what it held already or never held: those are no change)."""
        held = self.index(holder)
        for topic_filter in removed:
            if topic_filter in held:
                held.discard(topic_filter)
                self._went(holder, topic_filter)
        for topic_filter in added:
            if topic_filter not in held:
                held.add(topic_filter)
                self._came(holder, topic_filter)

    def replace(self, holder: H, filters: Set[str]) -> None:
        """``holder`` holds exactly ``filters`` now."""
        held = set(self.index(holder))
        self.change(holder, filters - held, held - filters)

    def leave(self, holder: H) -> None:
        """``holder`` is gone, and so is every filter it held."""
        held = self._held.get(holder)
        if held is not None:
            self.change(holder, (), list(held))
            del self._held[holder]
        self._views.pop(holder, None)
        self._dirty.discard(holder)

    def taken(self) -> Iterator[tuple[H, frozenset[str], frozenset[str]]]:
        """Each listener whose view changed, with the filters that came into it and those
        that went, since it was last given them (consume it whole)."""
        dirty, self._dirty = self._dirty, set()
        for holder in dirty:
            view = self._views.get(holder)
            if view:
                added, removed = view.take()
                yield holder, added, removed

    def _came(self, holder: H, topic_filter: str) -> None:
        others = self._count.get(topic_filter, 0)
        self._count[topic_filter] = others + 1
        if others < 2:
            self._flip(holder, topic_filter, others, came=True)

    def _went(self, holder: H, topic_filter: str) -> None:
        others = self._count.pop(topic_filter) - 1
        if others:
            self._count[topic_filter] = others
        if others < 2:
            self._flip(holder, topic_filter, others, came=False)

    def _flip(self, holder: H, topic_filter: str, others: int, *, came: bool) -> None:
        """``holder`` took or let go of a filter that ``others`` (0 or 1) other holders hold:
        with none, every other listener's view changes; with one, that one's alone (it
        shares the filter with ``holder`` now, or holds it alone again)."""
        for other, view in self._views.items():
            if other == holder or (others and topic_filter not in self._held[other]):
                continue
            if came:
                view.came(topic_filter)
            else:
                view.went(topic_filter)
            self._dirty.add(other)
