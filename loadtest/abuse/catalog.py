"""Every attack of ``python -m loadtest abuse``, by name, in the order they run: the
attacks of issue 33, each confirmed against the heartbeat server on loopback."""

from __future__ import annotations

from .attack import Attack
from .escape import PatternEscape
from .floods import ConnectFlood, HugeIds, WildcardFlood
from .forgery import WildcardIds, WillForgery
from .retained import RetainedFill
from .starve import StatusStarve

__all__ = ["ATTACKS", "pick"]

ATTACKS: dict[str, type[Attack]] = {
    cls.name: cls
    for cls in (
        WillForgery,
        HugeIds,
        WildcardFlood,
        RetainedFill,
        PatternEscape,
        StatusStarve,
        WildcardIds,
        ConnectFlood,
    )
}
"""Attack classes by name."""


def pick(names: str) -> list[type[Attack]]:
    """The attacks a comma-separated list names (``all``: every one), in :data:`ATTACKS` order.
    Raises ValueError naming an unknown one."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted == ["all"]:
        return list(ATTACKS.values())
    unknown = [n for n in wanted if n not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attack {', '.join(unknown)}: one of {', '.join(ATTACKS)}")
    return [cls for name, cls in ATTACKS.items() if name in wanted]
