"""An engine's transports by file descriptor: a list indexed by descriptor.

The kernel hands out the lowest free descriptor, so the descriptors of a process's
sockets are dense small integers and a list indexed by them has few holes. A dict
keyed by descriptor would cost every connection its key (a descriptor past 256 is an
int object of its own, 28 bytes) and a dict entry (about 37 bytes), against the
list's 8-byte slot; and every event an epoll pass takes is looked up here, where
indexing a list is cheaper than hashing into a dict.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["FdTable"]

_T = TypeVar("_T")


class FdTable(Generic[_T]):
    """What each open descriptor of an engine belongs to.

    ``reserve``: descriptors below it have a slot from the start (a member of the
    engine's epoll set that is not in the table, such as its nested set of listeners,
    can then be looked up in :attr:`slots` without a bounds check).
    """

    __slots__ = ("slots", "_count")

    def __init__(self, reserve: int = 0) -> None:
        self.slots: list[_T | None] = [None] * reserve
        """Indexed by descriptor: what holds it, or None. Never shrinks, so a
        descriptor that had a slot keeps one (the engine's pass reads this directly)."""
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, fd: int, item: _T) -> None:
        """``item`` holds ``fd`` from now on; the descriptor must not be held already."""
        if fd < 0:
            raise ValueError(f"not a descriptor: {fd}")
        slots = self.slots
        if fd >= len(slots):
            slots.extend([None] * (fd + 1 - len(slots)))
        elif slots[fd] is not None:
            raise ValueError(f"descriptor {fd} is held already")
        slots[fd] = item
        self._count += 1

    def get(self, fd: int) -> _T | None:
        """What holds ``fd``, or None."""
        slots = self.slots
        return slots[fd] if 0 <= fd < len(slots) else None

    def remove(self, fd: int, item: _T) -> bool:
        """Free ``fd`` if ``item`` holds it; returns whether it did."""
        slots = self.slots
        if 0 <= fd < len(slots) and slots[fd] is item:
            slots[fd] = None
            self._count -= 1
            return True
        return False

    def values(self) -> list[_T]:
        """Everything held, by descriptor (a snapshot)."""
        return [item for item in self.slots if item is not None]
