"""What a supervised worker's link to the authority exports on ``/metrics``."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

from ...prometheus import Families, Metric

__all__ = ["bus_figures"]


class _Link(Protocol):
    worker: int
    connected: bool
    reconnects: int
    resent: int
    routed: int
    routed_unkept: int

    @property
    def _unacked(self) -> Sized: ...


def bus_figures(link: _Link) -> list[Metric]:
    """Link state and traffic of a :class:`~.local.BusCoordinator`."""
    f = Families({"worker": str(link.worker)})
    f.gauge("heartbeat_bus_connected", "1 while linked to the supervisor's authority.", int(link.connected))
    f.gauge("heartbeat_bus_unacked", "Reports and QoS 1/2 messages waiting for the authority.", len(link._unacked))
    f.counter("heartbeat_bus_reconnects_total", "Links to the authority re-established.", link.reconnects)
    f.counter("heartbeat_bus_resent_total", "Session reports sent again after a reconnection.", link.resent)
    f.counter("heartbeat_bus_routed_total", "Messages routed to other workers' subscribers.", link.routed)
    f.counter(
        "heartbeat_bus_routed_unkept_total",
        "QoS 1 and 2 messages routed without a copy kept for a resend (too many bytes awaited acknowledgement).",
        link.routed_unkept,
    )
    return f.families
