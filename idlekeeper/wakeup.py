"""A wake-up for the dense engine's epoll set from outside its passes.

A connection dropped by the reaper (an expiry) or by another task (a takeover) must
have its protocol told on the engine's next pass, and that pass must come even if no
socket is ready: one byte into a socketpair whose reading end sits in the engine's
urgent set makes it come. Several wake-ups before the pass cost one byte. Pure
standard library.
"""

from __future__ import annotations

import contextlib
import socket

__all__ = ["Wakeup"]


class Wakeup:
    """A socketpair: :meth:`wake` makes :attr:`fd` readable until :meth:`drain`."""

    __slots__ = ("_r", "_w", "fd", "woken")

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.fd = self._r.fileno()
        """The descriptor to watch for reading."""
        self.woken = False
        """Whether a wake-up waits to be drained."""

    def wake(self) -> None:
        """Make :attr:`fd` readable (once until the next :meth:`drain`)."""
        if self.woken:
            return
        self.woken = True
        with contextlib.suppress(BlockingIOError):  # already full of wake-ups
            self._w.send(b"\0")

    def drain(self) -> None:
        """Take every wake-up so far."""
        self.woken = False
        with contextlib.suppress(BlockingIOError):
            while self._r.recv(4096):
                pass

    def close(self) -> None:
        """Close both ends."""
        self._r.close()
        self._w.close()
