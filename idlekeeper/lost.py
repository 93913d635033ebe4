"""Why a dense engine's connection ended: the exceptions its protocol's ``connection_lost`` is given.

Besides these, ``connection_lost`` is given None (a close of ours, a clean EOF) or
the ``OSError`` that broke the connection. Named and based as trio's own: an expiry
is a :class:`trio.TooSlowError`, as ``trio.fail_after`` raises, and a connection the
engine's close ended is a :class:`trio.ClosedResourceError`. Kept apart from
:mod:`.protocol` so that the transport, which raises :class:`ExpiredError`, need not
import the callbacks.
"""

from __future__ import annotations

import warnings

import trio

from .deadlines import Reason

__all__ = ["EngineClosedError", "ExpiredError"]


class ExpiredError(trio.TooSlowError):
    """A deadline ended the connection; :attr:`reason` says which one."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(f"connection expired: {reason.value} timeout")
        self.reason = reason
        """Which deadline passed."""


class EngineClosedError(trio.ClosedResourceError):
    """The engine closed the connection because the engine itself closed (its
    ``open_engine`` block exited: the server is shutting down or was cancelled)."""

    def __init__(self) -> None:
        super().__init__("the engine closed")


# The names before 0.2, kept for a release.
_RENAMED = {"Expired": ExpiredError, "EngineClosed": EngineClosedError}


def renamed(module: str, name: str) -> type[Exception] | None:
    """The class an old name now stands for, with a DeprecationWarning; None if ``name`` is not one."""
    new = _RENAMED.get(name)
    if new is not None:
        warnings.warn(
            f"{module}.{name} is deprecated; use {module}.{new.__name__} (a {new.__mro__[1].__module__}."
            f"{new.__mro__[1].__name__})",
            DeprecationWarning,
            stacklevel=3,
        )
    return new


def __getattr__(name: str) -> type[Exception]:
    new = renamed(__name__, name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return new
