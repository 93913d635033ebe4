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
- **The presence prefix**, :data:`DEFAULT_PRESENCE_PREFIX` (``$SYS/presence/``): under
  ``$``, so a filter that starts with a wildcard (``#``, ``+/...``) never matches a
  presence topic (MQTT-4.7.2-1), as Mosquitto keeps its ``$SYS/broker/...``, EMQX its
  ``$SYS/brokers/<node>/clients/<id>/connected`` and AWS IoT its
  ``$aws/events/presence/...``. Whoever wants presence subscribes to
  ``$SYS/presence/#`` (or one device's topic). :func:`check_presence_prefix` says
  which prefixes a server may be given: ``presence/``, the prefix before issue 28, is
  one of them.
- **Retained messages** (``--retain-available``), on unless told otherwise. Off, as
  Mosquitto's ``retain_available false``: a client's PUBLISH with RETAIN 1 ends its
  connection (5.0: DISCONNECT 0x9A, Retain not supported, which its CONNACK announced
  with Retain Available 0; 3.1.1 has no way to say it, the connection just closes), and
  a CONNECT whose Will has RETAIN 1 is refused (5.0: CONNACK 0x9A; 3.1.1: closed
  unanswered). Presence events are the server's own, not a client's: they stay
  retained unless ``--no-retain-presence``.
- **Payloads** (``--message-size-limit``), unbounded (0) unless told otherwise; the
  whole packet is bounded anyway by ``--max-packet-size``. A PUBLISH whose payload is
  longer is neither routed nor retained but answered, as Mosquitto 2.0 does: QoS 0
  dropped, QoS 1 PUBACK, QoS 2 PUBREC, with 0x97 (Quota exceeded) in 5.0, where
  Mosquitto sends 0x95, which MQTT 5 allows in neither (paho takes it for a malformed
  packet, reconnects and sends the message again, for ever). A Will's
  payload longer refuses the CONNECT: CONNACK 0x95 in 5.0, 5 (not authorized) in 3.1.1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

__all__ = [
    "BRIDGE_STATE",
    "DEFAULT_MAX_CLIENT_ID",
    "DEFAULT_MAX_QOS",
    "DEFAULT_PRESENCE_PREFIX",
    "DEFAULT_MAX_SUBSCRIPTIONS",
    "DEFAULT_MAX_SUBSCRIPTION_BYTES",
    "DEFAULT_MAX_USERNAME",
    "LEGACY_PRESENCE_PREFIX",
    "MAX_PRESENCE_PREFIX",
    "SessionPolicy",
    "check_presence_prefix",
    "utf8_length",
]

DEFAULT_MAX_QOS = 2
"""The highest QoS a session grants and routes at unless told otherwise."""
DEFAULT_PRESENCE_PREFIX = "$SYS/presence/"
"""Where presence events are published unless told otherwise (``$SYS/presence/<client-id>``);
devices may not publish there, and ``#`` does not match it (see the module docs)."""
LEGACY_PRESENCE_PREFIX = "presence/"
"""The default before issue 28, which ``#`` matches; ``--presence-prefix presence/`` keeps it."""
MAX_PRESENCE_PREFIX = 1024
"""Bytes of UTF-8 a presence prefix may have (each presence topic is the prefix plus a client id)."""
DEFAULT_MAX_CLIENT_ID = 256
"""Bytes of UTF-8 a client id may have (see the module docs)."""
DEFAULT_MAX_USERNAME = 1024
"""Bytes of UTF-8 a username may have."""
DEFAULT_MAX_SUBSCRIPTIONS = 1000
"""Topic filters one client may hold at once."""
DEFAULT_MAX_SUBSCRIPTION_BYTES = 64 * 1024
"""Bytes of UTF-8 filter text one client may hold at once."""


# What the reader refuses in any topic from a client (controls, non-characters), and the
# surrogates that a command line decoded with surrogateescape may hold (not UTF-8).
_NONCHARACTERS = "\\ufdd0-\\ufdef" + "".join(f"\\U{p:04x}fffe\\U{p:04x}ffff" for p in range(17))
_UNFIT = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f\\ud800-\\udfff{_NONCHARACTERS}]")


def utf8_length(text: str) -> int:
    """``text``'s length on the wire; almost every id and topic is ASCII, which skips the encode."""
    return len(text) if text.isascii() else len(text.encode())


def check_presence_prefix(prefix: str) -> str:
    """``prefix`` if presence topics (``<prefix><client-id>``) can be built on it, else
    :class:`ValueError` saying why.

    The prefix must be a valid start of a topic name that ends a level: not empty,
    ending with ``/`` (so ``<prefix>#`` is every presence topic and nothing else), with
    no ``+`` or ``#`` (a topic name holds no wildcard, MQTT-4.7.1-1), no NUL (MQTT-1.5.3-2)
    or other control character (subscribers such as ``mosquitto_sub`` drop on them), not
    under ``$share/`` (shared subscriptions' syntax, which no topic is published on), and
    at most :data:`MAX_PRESENCE_PREFIX` bytes. A prefix that does not start with ``$``
    (``presence/``, the old default) is accepted: ``#`` subscribers then hear presence.
    """
    if not prefix:
        raise ValueError("the presence prefix is empty: presence topics would be bare client ids")
    if "+" in prefix or "#" in prefix:
        raise ValueError(f"the presence prefix {prefix!r} holds a wildcard (+ or #): a topic name may not")
    if "\0" in prefix:
        raise ValueError(f"the presence prefix {prefix!r} holds NUL, which MQTT forbids in a topic")
    if _UNFIT.search(prefix):
        raise ValueError(
            f"the presence prefix {prefix!r} holds a control character, a Unicode non-character or a surrogate"
        )
    if not prefix.endswith("/"):
        raise ValueError(f"the presence prefix {prefix!r} must end with '/' (for example $SYS/presence/)")
    if prefix.split("/", 1)[0] == "$share":
        raise ValueError(f"the presence prefix {prefix!r} is under $share/, which names shared subscriptions")
    if utf8_length(prefix) > MAX_PRESENCE_PREFIX:
        raise ValueError(f"the presence prefix is longer than {MAX_PRESENCE_PREFIX} bytes")
    return prefix


BRIDGE_STATE = "$SYS/broker/connection/"
"""Where bridges publish their state: ``$SYS/broker/connection/<client id>/state``."""


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
    # What an MQTT 5 CONNACK announces, and holds the client to (3.1.1 has no room for them).
    max_keepalive: int = 3600
    """The longest keep-alive a client gets: a 5.0 client asking more, or 0, is told
    this one (Server Keep Alive); a 3.1.1 client is held to it without being told."""
    receive_maximum: int = 20
    """QoS 1 and 2 messages a 5.0 client may have unacknowledged towards the server
    (``--max-inflight``); one more is DISCONNECT 0x93."""
    max_packet_size: int = 256 * 1024
    """The largest packet the server takes (and tells a 5.0 client, Maximum Packet Size)."""
    topic_alias_maximum: int = 10
    """Topic aliases a 5.0 client may set towards the server (``--max-topic-alias``; 0: none)."""
    outbound_topic_aliases: bool = True
    """Whether the server sets topic aliases towards a 5.0 client whose CONNECT allows
    them (``--outbound-topic-aliases``)."""
    session_expiry: int = 24 * 3600
    """Seconds a persistent session is kept (what a 5.0 client asking any non-zero
    Session Expiry Interval is told, in CONNACK)."""

    retain_available: bool = True
    """Whether clients may publish retained messages (and Wills); see the module docs."""
    message_size_limit: int = 0
    """The longest payload a client's PUBLISH or Will may carry, in bytes; 0: no limit."""
    bridge: bool = False
    """The session is a bridge's (its CONNECT said so, Mosquitto's ``try_private``): its
    subscriptions take No Local and Retain As Published, as Mosquitto gives them."""

    def reserved(self, topic: str) -> bool:
        """Whether only the server writes ``topic``: presence and the ``$`` topics, but a
        bridge's state (``$SYS/broker/connection/+/state``), which Mosquitto lets any
        client write, so that a bridge connecting here may say it (and leave its Will)."""
        if topic.startswith("$"):
            return not (topic.startswith(BRIDGE_STATE) and topic.endswith("/state") and topic.count("/") == 4)
        return topic.startswith(self.presence_prefix)
