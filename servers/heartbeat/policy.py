"""What a server allows a session, sans-IO: the limits the protocol state applies as
packets arrive, shared by every connection of a worker.

A :class:`SessionPolicy` holds the server's settings that a session needs while it
reads a CONNECT or a SUBSCRIBE (the QoS it grants, the topics only the server may
write, how long a client id or a username may be, how many filters a client may
hold), so that the session decides, without I/O, what to answer. One object per
worker, referenced by every session: a million sessions pay one pointer.

The bounds and why they are what they are:

- **Client ids**, at most :data:`DEFAULT_MAX_CLIENT_ID` (256) bytes of UTF-8. MQTT
  3.1.1 asks a server to take 1 to 23 characters and lets it take more; cloud IoT
  services stop at 128 (AWS IoT, Azure IoT Hub), a UUID is 36, a MAC-derived id 17.
  Mosquitto and EMQX allow 65,535, and at that size each id that connects once is a
  64 KB device record kept for days: 2,000 connections put 503 MB in Redis. Longer:
  CONNACK 2 (identifier rejected). An id holding ``+`` or ``#`` is refused the same
  way: it names the device's presence topic, and MQTT forbids wildcards in a topic
  name (MQTT-3.3.2-2).
- **Usernames**, at most :data:`DEFAULT_MAX_USERNAME` (1,024) bytes: room for an email
  address (254) or a long service account name, as EMQX's 1,024. Longer: CONNACK 4.
- **Subscriptions per client**, at most :data:`DEFAULT_MAX_SUBSCRIPTIONS` (1,000)
  filters and :data:`DEFAULT_MAX_SUBSCRIPTION_BYTES` (64 KiB) of filter text. A device
  holds a few, a dashboard tens; AWS IoT allows 50. Matching does not slow with the
  number of filters, but each is memory on every worker and gateway. Past it: 0x80
  (failure) in that filter's SUBACK return code.
- **Topics only the server writes**: the presence prefix and every ``$`` topic (MQTT
  4.7.2 reserves them for the server). A client's PUBLISH there is dropped; its Will
  there refuses the CONNECT.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_CLIENT_ID",
    "DEFAULT_MAX_QOS",
    "DEFAULT_PRESENCE_PREFIX",
    "DEFAULT_MAX_SUBSCRIPTIONS",
    "DEFAULT_MAX_SUBSCRIPTION_BYTES",
    "DEFAULT_MAX_USERNAME",
    "SessionPolicy",
    "utf8_length",
]

DEFAULT_MAX_QOS = 2
"""The highest QoS a session grants and routes at unless told otherwise."""
DEFAULT_PRESENCE_PREFIX = "presence/"
"""Where presence events are published unless told otherwise; devices may not publish there."""
DEFAULT_MAX_CLIENT_ID = 256
"""Bytes of UTF-8 a client id may have (see the module docs)."""
DEFAULT_MAX_USERNAME = 1024
"""Bytes of UTF-8 a username may have."""
DEFAULT_MAX_SUBSCRIPTIONS = 1000
"""Topic filters one client may hold at once."""
DEFAULT_MAX_SUBSCRIPTION_BYTES = 64 * 1024
"""Bytes of UTF-8 filter text one client may hold at once."""


def utf8_length(text: str) -> int:
    """``text``'s length on the wire; almost every id and topic is ASCII, which skips the encode."""
    return len(text) if text.isascii() else len(text.encode())


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """The server's rules for its sessions (see the module docs)."""

    max_qos: int = DEFAULT_MAX_QOS
    """Highest QoS granted to subscriptions and routed for publishes."""
    presence_prefix: str = DEFAULT_PRESENCE_PREFIX
    """Where the server publishes presence; no client may write there."""
    max_client_id: int = DEFAULT_MAX_CLIENT_ID
    max_username: int = DEFAULT_MAX_USERNAME
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    held: Callable[[str], tuple[Collection[str], int]] | None = None
    """The filters a client id holds on this worker now (the broker's own set) and their
    bytes; None: subscriptions are not counted (a session tested on its own)."""

    def reserved(self, topic: str) -> bool:
        """Whether only the server writes ``topic``: presence and the ``$`` topics."""
        return topic.startswith("$") or topic.startswith(self.presence_prefix)
