"""Classes that only their ``open_*`` function may create, as trio's own are.

A keeper or an engine owns things only its ``open_*`` block cleans up (a reaper task,
a run-wide instrument, an epoll, a socketpair), so a direct ``Keeper(...)`` would
leak them. trio does the same for its ``Nursery`` and ``CancelStatus``.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

__all__ = ["NoPublicConstructor"]

T = TypeVar("T")


class NoPublicConstructor(type):
    """A metaclass whose classes refuse ``Class(...)`` and are made by ``Class._create(...)``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        opener = getattr(cls, "_OPENER", "its open_* function")
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} has no public constructor; use {opener}")

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc,no-any-return]
