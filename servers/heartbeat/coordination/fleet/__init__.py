"""The fleet coordinator (``--cluster``): gateways sharing one Redis (≥ 7) for presence,
routing, persistent sessions and retained messages. :class:`RedisCoordinator`
(:mod:`.coordinator`) is the :class:`~servers.heartbeat.coordination.Coordinator` a
worker sees; each of its jobs is a module here, and ``lua/`` holds the Lua scripts
(:mod:`.scripts` reads them; they ship as package data)."""

from __future__ import annotations

from .coordinator import RedisCoordinator

__all__ = ["RedisCoordinator"]
