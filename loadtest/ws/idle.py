"""Idle memory: N WebSockets opened and left alone; the server's RSS added per connection."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..sampler import processes, rss_bytes
from .connect import close_all, open_websockets

__all__ = ["IdleFigures", "idle_memory"]

WARM_UP = 50
"""Connections opened and closed before the reading: a server's first WebSocket loads
code and fills caches once, which is no connection's cost."""


@dataclass
class IdleFigures:
    """What :func:`idle_memory` measured."""

    connections: int = 0
    errors: int = 0
    open_s: float = math.nan
    rss_before: int = 0
    rss_after: int = 0
    per_connection: float = math.nan
    """Bytes of server RSS per idle WebSocket."""


def idle_memory(port: int, pids: list[int], n: int, settle: float = 1.0) -> IdleFigures:
    """Open ``n`` WebSockets to the server (``pids``, its whole tree), wait ``settle`` s, and
    take the RSS it added over the connections it holds; they are closed on return."""
    warm = open_websockets(port, min(WARM_UP, n))
    close_all(warm.peers)
    time.sleep(settle)
    procs = processes(pids)
    out = IdleFigures(rss_before=rss_bytes(procs))
    opened = open_websockets(port, n)
    try:
        out.connections, out.errors, out.open_s = len(opened.peers), opened.errors, opened.seconds
        # The server's garbage collector and allocator settle; then every connection is idle.
        time.sleep(settle)
        out.rss_after = rss_bytes(procs)
    finally:
        close_all(opened.peers)
    if out.connections:
        out.per_connection = (out.rss_after - out.rss_before) / out.connections
    return out
