"""``python -m loadtest fuzz``: hostile input against our servers, judged. The command is
:mod:`.cli`; the seeded corpus and its mutators, the connections that send it, the
canary beside them (``python -m loadtest.fuzz.canary``, a process of its own), the
runner and the judge are modules here.

:func:`main` and :func:`run` are the command's (:mod:`.cli`), imported on first use:
importing the package must not import the canary, through the command, before
``python -m loadtest.fuzz.canary`` runs it as ``__main__``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cli import machine, main, render, run

__all__ = ["machine", "main", "render", "run"]


def __getattr__(name: str) -> Any:
    """The command's names (:mod:`.cli`), imported when first asked for."""
    if name in __all__:
        from . import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
