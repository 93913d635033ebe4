"""Live progress for long load runs: one refreshing panel on a terminal (rich), or
a plain line every few seconds when the output is a file or a pipe."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from rich.console import Console
from rich.live import Live as RichLive
from rich.table import Table

__all__ = ["Live", "Phases", "elapsed", "run_progress"]


class Phases(Protocol):
    """A run's timeline as its progress reads it (:class:`~loadtest.workload.Timeline`, the fleet's)."""

    @property
    def start(self) -> float:
        """When the first device connects (``CLOCK_MONOTONIC``): the results' time zero."""
        ...

    def phase(self, now: float) -> str:
        """The phase the run is in at ``now``."""
        ...


def elapsed(start: float, now: float) -> float:
    """Seconds of the run at ``now``, counted from ``start`` as the results and plots count
    them; 0 before it.

    The timeline is laid out a couple of seconds ahead, for the generator processes to
    start and import, so the first progress comes before ``start``: those seconds are the
    "starting" phase, not a negative time.
    """
    return max(0.0, now - start)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.1f}" if abs(value) < 100 and value != int(value) else f"{value:,.0f}"
    return str(value)


def run_progress(
    timeline: Phases,
    now: float,
    devices: int,
    silent_share: float,
    totals: dict[str, float],
    *,
    server_online: float,
    rss_mb: float,
    fds: float,
) -> dict[str, Any]:
    """A device run's state at ``now`` as :meth:`Live.update` shows it: its phase and
    :func:`elapsed` time on ``timeline``, the generators' summed progress (``totals``),
    and what is known of the server (NaN: nothing)."""
    return {
        "phase": timeline.phase(now),
        "elapsed": elapsed(timeline.start, now),
        "devices": devices,
        "silent": round(devices * silent_share),
        **totals,
        "server_online": server_online,
        "rss_mb": rss_mb,
        "fds": fds,
    }


class Live:
    """``with Live() as live: live.update({...})``: phase, devices connected, online, detected."""

    FIELDS = (
        ("phase", "phase"),
        ("elapsed", "elapsed s"),
        ("started", "connecting"),
        ("online", "online (devices)"),
        ("server_online", "online (server)"),
        ("detected", "silent detected"),
        ("failed", "failed"),
        ("rss_mb", "server RSS MB"),
        ("fds", "server files"),
    )

    def __init__(self, enabled: bool = True, every: float = 5.0) -> None:
        self.enabled = enabled
        self._console = Console(file=sys.stdout)
        self._tty = self._console.is_terminal
        self._live: RichLive | None = None
        self._every = every
        self._next = 0.0

    def __enter__(self) -> Live:
        if self.enabled and self._tty:
            self._live = RichLive(console=self._console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, state: dict[str, Any]) -> None:
        """Show the latest state (rate-limited when not on a terminal)."""
        if not self.enabled:
            return
        shown = [(label, _fmt(state[key])) for key, label in self.FIELDS if key in state]
        if "silent" in state and "detected" in state:
            shown = [(k, f"{v} of {state['silent']:,}" if k == "silent detected" else v) for k, v in shown]
        if self._live is not None:
            table = Table(show_header=True, header_style="bold", box=None)
            for label, _ in shown:
                table.add_column(label, justify="right")
            table.add_row(*(v for _, v in shown))
            self._live.update(table)
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._every
            print("  " + "  ".join(f"{k}={v}" for k, v in shown), flush=True)
