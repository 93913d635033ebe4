"""Why a dense engine's connection ended: the exceptions its protocol's ``connection_lost`` is given.

Besides these, ``connection_lost`` is given None (a close of ours, a clean EOF) or
the ``OSError`` that broke the connection. Kept apart from :mod:`.protocol` so that
the transport, which raises :class:`Expired`, need not import the callbacks.
"""

from __future__ import annotations

from .deadlines import Reason

__all__ = ["EngineClosed", "Expired"]


class Expired(TimeoutError):
    """A deadline ended the connection; :attr:`reason` says which one."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(f"connection expired: {reason.value} timeout")
        self.reason = reason
        """Which deadline passed."""


class EngineClosed(ConnectionAbortedError):
    """The engine stopped (the server is shutting down or was cancelled)."""

    def __init__(self) -> None:
        super().__init__("the engine stopped")
