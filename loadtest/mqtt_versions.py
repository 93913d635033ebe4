"""Which MQTT version each simulated device speaks: the ``--protocol`` option of the device
load, parsed, dealt out over the devices, and named. Pure.

The option is one version for every device, or a mix:

- ``3.1``, ``3.1.1`` or ``5`` (also ``5.0``): every device speaks that version;
- ``mixed``: half the devices 5.0, half 3.1.1 (the same as ``5:0.5``);
- ``VERSION:SHARE,...``: those shares of the devices speak those versions, the rest
  3.1.1; ``5:0.5`` is half 5.0, ``3.1:0.1,5:0.3`` is 10% 3.1, 30% 5.0 and 60% 3.1.1.
  Shares are fractions from 0 to 1 and add up to at most 1 (exactly 1 when 3.1.1 is
  listed too).

Versions go by their CONNECT protocol level: 3 (3.1, ``MQIsdp``), 4 (3.1.1), 5 (5.0).
"""

from __future__ import annotations

import argparse
import random

__all__ = ["LEVELS", "NAMES", "V311", "V5", "canonical", "deal", "parse_mix", "protocol_option"]

V31, V311, V5 = 3, 4, 5
LEVELS = {"3.1": V31, "3.1.1": V311, "5": V5, "5.0": V5}
"""Version names as the option takes them, to protocol levels."""
NAMES = {V31: "3.1", V311: "3.1.1", V5: "5.0"}
"""Protocol levels to the names reports use."""
_ALIASES = {"mixed": "5:0.5"}
_EPSILON = 1e-9


def parse_mix(text: str) -> dict[int, float]:
    """The share of devices of each protocol level (shares add up to 1); ValueError if
    ``text`` is not in the option's syntax (see the module's docstring)."""
    text = _ALIASES.get(text.strip().lower(), text.strip())
    if not text:
        raise ValueError("an empty protocol")
    items = [item.strip() for item in text.split(",")]
    if len(items) == 1 and ":" not in items[0]:
        return {_level(items[0]): 1.0}
    shares: dict[int, float] = {}
    for item in items:
        name, colon, value = item.partition(":")
        if not colon:
            raise ValueError(f"{item!r}: in a mix every version needs its share (VERSION:SHARE)")
        level = _level(name)
        if level in shares:
            raise ValueError(f"version {name.strip()} is listed twice")
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: the share must be a number from 0 to 1") from None
        if not 0 <= share <= 1:
            raise ValueError(f"{item!r}: the share must be from 0 to 1")
        shares[level] = share
    total = sum(shares.values())
    if total > 1 + _EPSILON:
        raise ValueError(f"the shares add up to {total:g}, over 1")
    if V311 in shares:
        if total < 1 - _EPSILON:
            raise ValueError(f"with 3.1.1 listed the shares must add up to 1, not {total:g}")
    else:
        shares[V311] = max(0.0, 1.0 - total)
    return {level: share for level, share in sorted(shares.items()) if share > 0}


def _level(name: str) -> int:
    level = LEVELS.get(name.strip())
    if level is None:
        raise ValueError(f"unknown MQTT version {name.strip()!r}: one of 3.1, 3.1.1, 5")
    return level


def canonical(text: str) -> str:
    """``text`` written the one way: ``3.1.1``, ``5.0``, or ``3.1.1:0.5,5.0:0.5``."""
    mix = parse_mix(text)
    if len(mix) == 1:
        return NAMES[next(iter(mix))]
    return ",".join(f"{NAMES[level]}:{share:g}" for level, share in mix.items())


def protocol_option(text: str) -> str:
    """``--protocol``'s argparse type: the canonical form, or a usage error."""
    try:
        return canonical(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def deal(devices: int, text: str, seed: int) -> str:
    """Each device's protocol level as one character (``"3"``, ``"4"``, ``"5"``), in device
    order; the counts are the shares rounded (largest remainders first), so they add up to
    ``devices``, and which device gets which is shuffled with ``seed``. Empty when every
    device speaks 3.1.1 (the generators' default)."""
    mix = parse_mix(text)
    if set(mix) == {V311}:
        return ""
    exact = {level: share * devices for level, share in mix.items()}
    counts = {level: int(x) for level, x in exact.items()}
    short = devices - sum(counts.values())
    for level in sorted(exact, key=lambda lv: exact[lv] - counts[lv], reverse=True)[:short]:
        counts[level] += 1
    out = [str(level) for level, n in counts.items() for _ in range(n)]
    # A generator of its own: the roles (silent, vanish, reconnect) are dealt as before.
    random.Random(f"protocols/{seed}").shuffle(out)
    return "".join(out)
