"""What the load tests write: the Markdown table of targets (each figure with its ratio to
ours), why a target has no row, the PASS/FAIL line, and the JSON and Markdown files."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Column",
    "figure",
    "number",
    "plural",
    "ratio",
    "show_table",
    "skip_reason",
    "table",
    "verdict",
    "write_json",
    "write_table",
    "written",
]

Column = tuple[str, str, str, bool]
"""A table column: the row's key, its title, its unit, and whether higher is better."""


def number(value: Any) -> float:
    """``value`` as a float; NaN when it is missing or not a number (a figure a run did not reach)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def figure(value: Any, spec: str = ".1f", unit: str = "", *, why: str = "", missing: str = "n/a") -> str:
    """``value`` formatted by ``spec``, then ``unit`` as it is (``" s"``, ``"/s"``); ``missing``
    (and ``why``, in brackets) for a figure a run has no samples of (NaN or missing), where
    a format would print ``nan``. Tables pass ``missing="—"``, as their other cells have it."""
    v = number(value)
    if math.isnan(v):
        return f"{missing} ({why})" if why else missing
    return f"{v:{spec}}{unit}"


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and what it counts, in the singular for one: ``1 worker``, ``3 workers``."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def _cell(value: float, ours: float, unit: str) -> str:
    if value != value:
        return "—"
    text = f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:,.2f}"
    text += f" {unit}" if unit else ""
    if ours == ours and ours != 0 and value != ours:
        ratio = value / ours
        text += f" ({ratio:.0f}×)" if ratio >= 10 else f" ({ratio:.1f}×)" if ratio >= 1 else f" ({ratio:.2f}×)"
    return text


def table(
    rows: dict[str, dict[str, float]],
    columns: Sequence[Column],
    missing: dict[str, str],
    ours_for: Callable[[str], str] | None = None,
) -> str:
    """A Markdown table: one row per target, each figure with its ratio to idlekeeper's
    (to the row ``ours_for(name)`` names, when given: say ours on the same protocol)."""
    head = "| target | " + " | ".join(title for _, title, _, _ in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        ours = rows.get("idlekeeper" if ours_for is None else ours_for(name), {})
        cells = [_cell(row.get(key, math.nan), ours.get(key, math.nan), unit) for key, _, unit, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, why in missing.items():
        lines.append(f"| {name} | not run: {why} |" + " |" * (len(columns) - 1))
    return "\n".join(lines)


def ratio(ours: float, theirs: float, times: str = "×", unknown: str = "—") -> str:
    """``ours / theirs`` to two places, or ``unknown`` where either figure is missing or theirs is 0."""
    if ours != ours or theirs != theirs or theirs == 0:
        return unknown
    return f"{ours / theirs:.2f}{times}"


def skip_reason(exc: BaseException) -> str:
    """Why a target has no row: the first line of its error, or the error's name."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def verdict(passed: bool) -> str:
    """A judged run's last report line."""
    return f"result                 {'PASS' if passed else 'FAIL'}"


def written(paths: Iterable[str | Path]) -> str:
    """The report line that says where the results went."""
    return "written                " + ", ".join(str(p) for p in paths)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` (its directory made if need be); the path.
    A value JSON has no type for goes through ``float``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=float))
    return out


def write_table(json_path: Path, text: str) -> Path:
    """Write the Markdown ``text`` next to the JSON results, as ``.md``; its path."""
    out = json_path.with_suffix(".md")
    out.write_text(text + "\n")
    return out


def show_table(json_path: Path, text: str) -> None:
    """Write the Markdown ``text`` next to the JSON results (:func:`write_table`), then
    print it and where both went."""
    md = write_table(json_path, text)
    print("\n" + text)
    print("\n" + written([json_path, md]))
