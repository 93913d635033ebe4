"""Live progress for long load runs: one refreshing panel on a terminal (rich), or
a plain line every few seconds when the output is a file or a pipe."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live as RichLive
from rich.table import Table

__all__ = ["Live", "run_progress"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.1f}" if abs(value) < 100 and value != int(value) else f"{value:,.0f}"
    return str(value)


def run_progress(
    phase: str,
    elapsed: float,
    devices: int,
    silent_share: float,
    totals: dict[str, float],
    *,
    server_online: float,
    rss_mb: float,
    fds: float,
) -> dict[str, Any]:
    """A device run's state as :meth:`Live.update` shows it: its phase, the generators'
    summed progress (``totals``), and what is known of the server (NaN: nothing)."""
    return {
        "phase": phase,
        "elapsed": elapsed,
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
