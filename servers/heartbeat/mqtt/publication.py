"""One application message on its way to subscribers: the value a session's PUBLISH
routes, a Will publishes, and the coordinators carry between workers and gateways,
in place of its fields one by one."""

from __future__ import annotations

from .records import record

__all__ = ["Publication"]


@record
class Publication:
    """A message as its publisher sent it."""

    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    """The flag it was published with (kept for Retain As Published; a retained copy
    for a new subscription is sent with the flag set whatever this says)."""
    properties: bytes = b""
    """An MQTT 5 publisher's properties that reach subscribers (packed, without their
    length: :func:`.v5.outbound.forwarded`); empty from a 3.1.1 client."""
