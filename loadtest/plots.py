"""Small PNG plots of a device run: devices online over time, the detection-lateness
histogram, and the server's RSS over time. Sized to be committed next to
BENCHMARKS.md (a few tens of kilobytes each)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server

import matplotlib.pyplot as plt

__all__ = ["device_plots"]

_SIZE = (6.4, 3.2)
_DPI = 80


def _phases(ax: Any, r: dict[str, Any]) -> None:
    tl = r["timeline"]
    ax.axvline(tl["acts"], color="grey", linestyle=":", linewidth=1)
    ax.text(tl["acts"], ax.get_ylim()[1], " silence", va="top", fontsize=7, color="grey")
    if r.get("stall"):
        ax.axvspan(r["stall"]["from"], r["stall"]["to"], color="tab:red", alpha=0.12, linewidth=0)
        ax.text(r["stall"]["from"], ax.get_ylim()[1], " SIGSTOP", va="top", fontsize=7, color="tab:red")


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def device_plots(r: dict[str, Any], out: Path, stem: str | None = None) -> list[str]:
    """Write the three plots for result ``r`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or f"devices-{r['target']}-{r['devices']}"
    title = f"{r['target']}: {r['devices']:,} devices, keep-alive {r['options']['keepalive']} s"
    tl = r["timeline"]
    written = []

    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    prog = tl["progress"]
    ax.plot([p[0] for p in prog], [p[1] for p in prog], label="online (devices' view)", linewidth=1.2)
    server = [(s[0], s[4]) for s in tl["samples"] if s[4] == s[4]]
    if server:
        ax.plot([t for t, _ in server], [n for _, n in server], label="online (server /metrics)", linewidth=1.2)
    ax.set_xlabel("seconds")
    ax.set_ylabel("devices online")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    _phases(ax, r)
    written.append(_save(fig, out / f"{stem}-online.png"))

    close = r.get("server_view", {}).get("close_lateness_s")
    late = [v * 1000 for v in (close if close else r.get("lateness_s", []))]
    view = "server's close" if close else "device's view"
    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    if late:
        top = max(late)
        bins = max(10, min(60, math.ceil(top / 5) if top > 0 else 10))
        ax.hist(late, bins=bins, color="tab:blue")
        tick = r.get("tick_s")
        if tick:
            ax.axvline(
                tick * 1000, color="tab:red", linestyle="--", linewidth=1, label=f"one tick ({tick * 1000:g} ms)"
            )
            ax.legend(fontsize=7)
    ax.set_xlabel(f"ms after last packet + 1.5 x keep-alive ({view})")
    ax.set_ylabel("silent devices")
    ax.set_title(f"detection lateness, {len(late):,} silent devices", fontsize=9)
    written.append(_save(fig, out / f"{stem}-lateness.png"))

    fig, ax = plt.subplots(figsize=_SIZE, dpi=_DPI)
    samples = tl["samples"]
    ax.plot([s[0] for s in samples], [s[1] / 1e6 for s in samples], color="tab:green", linewidth=1.2)
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS, MB (all processes)")
    ax.set_title(title, fontsize=9)
    _phases(ax, r)
    written.append(_save(fig, out / f"{stem}-rss.png"))
    return written
