"""Whether to accept a WebSocket's opening handshake, and with which subprotocol.

Pure: a wsproto :class:`~wsproto.events.Request` in, an
:class:`~wsproto.events.AcceptConnection` or a refusal out, with the reason to log.

Why each refusal:

- **404** for another path than the listener's (``/mqtt`` by default, as EMQX and
  most browser clients assume).
- **403** for a browser page from an origin not on the allow-list. A browser sends
  ``Origin`` with every WebSocket and lets any page open one to any server, with the
  user's cookies; without the check, any site the user visits could talk to the
  server as the user (cross-site WebSocket hijacking). A client that sends no
  ``Origin`` is not a browser and is not asked for one.
- **400** when none of the subprotocols offered is one the listener speaks: MQTT over
  WebSockets requires the client to offer ``mqtt`` (MQTT-6.0.0-3; ``mqttv3.1`` from
  clients of 3.1's time), and the server to name the one it picked (MQTT-6.0.0-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wsproto.events import AcceptConnection, RejectConnection, Request

__all__ = ["MQTT_SUBPROTOCOLS", "Refusal", "WsPolicy"]

MQTT_SUBPROTOCOLS = ("mqtt", "mqttv3.1")
"""What MQTT clients offer, in the order the server prefers them."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """An opening handshake turned away: the response, and why (for the log)."""

    response: RejectConnection
    reason: str


def _origin(request: Request) -> str | None:
    for name, value in request.extra_headers:
        if bytes(name).lower() == b"origin":
            return bytes(value).decode("latin-1").strip().lower()
    return None


@dataclass(frozen=True, slots=True)
class WsPolicy:
    """A WebSocket listener's rules for the opening handshake.

    ``path``: the one request target served (a query string is ignored);
    ``subprotocols``: those spoken, preferred first; ``allowed_origins``: the browser
    origins let in (``https://dashboard.example.com``, compared without case), None
    for any.
    """

    path: str = "/mqtt"
    subprotocols: tuple[str, ...] = MQTT_SUBPROTOCOLS
    allowed_origins: frozenset[str] | None = field(default=None)

    def decide(self, request: Request) -> AcceptConnection | Refusal:
        """Accept ``request`` with the subprotocol chosen, or refuse it."""
        target = request.target.split("?", 1)[0]
        if target != self.path:
            return Refusal(RejectConnection(status_code=404), f"path {target[:64]!r} (served: {self.path})")
        origin = _origin(request)
        allowed = self.allowed_origins
        if origin is not None and allowed is not None and origin not in allowed:
            return Refusal(RejectConnection(status_code=403), f"origin {origin[:128]!r} is not allowed")
        offered = set(request.subprotocols)
        for name in self.subprotocols:
            if name in offered:
                return AcceptConnection(subprotocol=name)
        said = ", ".join(request.subprotocols[:4]) or "none"
        return Refusal(RejectConnection(status_code=400), f"subprotocols offered: {said[:128]} (spoken: mqtt)")
