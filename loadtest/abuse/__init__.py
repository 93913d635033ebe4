"""``python -m loadtest abuse``: the attacks of issue 33 replayed against our server and
Mosquitto with a healthy fleet beside them, judged. The command is :mod:`.cli`; the
attacks are :mod:`.forgery`, :mod:`.floods`, :mod:`.retained`, :mod:`.escape` and
:mod:`.starve` (listed in :mod:`.catalog`); the healthy fleet (:mod:`.fleet`, a process
of its own), the runner, the judge and the report are modules here.

:func:`main` is the command's (:mod:`.cli`), imported on first use: importing the
package must not import the fleet, through the command, before ``python -m
loadtest.abuse.fleet`` runs it as ``__main__``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cli import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    """The command's ``main`` (:mod:`.cli`), imported when first asked for."""
    if name in __all__:
        from . import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
