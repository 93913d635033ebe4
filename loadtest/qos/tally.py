"""What a subscriber saw of one publisher's numbered messages: each exactly once, and in order."""

from __future__ import annotations

__all__ = ["Tally"]


class Tally:
    """What the subscriber saw of one publisher's sequence: exactly once, in order."""

    __slots__ = ("ahead", "contiguous", "duplicates", "out_of_order")

    def __init__(self) -> None:
        self.contiguous = 0
        """Sequence numbers 0 .. contiguous - 1 have all arrived."""
        self.ahead: set[int] = set()
        """Arrived beyond a gap."""
        self.duplicates = 0
        self.out_of_order = 0

    def see(self, seq: int) -> None:
        """One delivery of ``seq``."""
        if seq == self.contiguous:
            self.contiguous += 1
            ahead = self.ahead
            while ahead and self.contiguous in ahead:
                ahead.remove(self.contiguous)
                self.contiguous += 1
        elif seq < self.contiguous or seq in self.ahead:
            self.duplicates += 1
        else:
            self.ahead.add(seq)
            self.out_of_order += 1

    @property
    def unique(self) -> int:
        """Distinct sequence numbers seen."""
        return self.contiguous + len(self.ahead)
