"""Topic aliases the server sets towards an MQTT 5.0 client (§3.3.2.3.4): its
PUBLISH packets name a topic once, with an alias, and from then on by the alias
alone, an empty topic and three bytes of property. A device that hears
``sensors/building-7/floor-3/room-12/temperature`` every few seconds is spared the
topic's bytes on every message after the first: on a metered cellular link, the
topic is often most of the packet.

Only for a client whose CONNECT gave a Topic Alias Maximum (the spec's consent; 0,
the default, forbids them) and only for the life of its network connection: a new
connection starts with none (MQTT-3.3.2-7), as does each instance of this class.

When every alias is taken, the one least recently used is given to the new topic;
the packet that does so carries the topic with it, so the client's map follows.
Topics shorter than :data:`MIN_TOPIC` bytes are sent as they are: the alias would
save nothing. A packet must be rewritten in the order it is written to the
socket (the client learns each alias from the packet that sets it), so the broker
does it as the bytes are queued. Pure: bytes in, bytes out.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from ..encoders import encode_frame
from .wire import pack_varint, read_varint

__all__ = ["MIN_TOPIC", "OutboundAliases"]

MIN_TOPIC = 4
"""Topics shorter than this many bytes are never aliased (an alias costs three)."""

_H = struct.Struct("!H")
_TOPIC_ALIAS = 0x23


class OutboundAliases:
    """The aliases of one connection: rewrites its PUBLISH packets to use them.

    ``maximum`` is the client's Topic Alias Maximum. ``set`` and ``used`` count the
    packets that set an alias and those sent by alias alone; ``saved`` the bytes the
    aliases spared the link, net of what setting them cost.
    """

    __slots__ = ("maximum", "set", "used", "saved", "_by_topic")

    def __init__(self, maximum: int) -> None:
        if not 0 < maximum <= 0xFFFF:
            raise ValueError(f"a Topic Alias Maximum is 1 to 65535, not {maximum}")
        self.maximum = maximum
        self.set = 0
        self.used = 0
        self.saved = 0
        self._by_topic: OrderedDict[bytes, int] = OrderedDict()

    def apply(self, data: bytes, max_packet_size: int = 0) -> bytes:
        """``data`` as it goes to the client: a PUBLISH by alias, or setting one; any
        other packet as it is. ``max_packet_size`` is the client's (0: no limit): a
        packet that setting an alias would make too large is sent as it is."""
        first = data[0]
        if first >> 4 != 3:
            return data
        length, pos = read_varint(data, 1, len(data))
        end = pos + length
        (topic_length,) = _H.unpack_from(data, pos)
        if topic_length < MIN_TOPIC:
            return data
        topic = data[pos + 2 : pos + 2 + topic_length]
        after_topic = pos + 2 + topic_length + (2 if first & 0x06 else 0)
        props_length, props_start = read_varint(data, after_topic, end)
        props_end = props_start + props_length
        by_topic = self._by_topic
        alias = by_topic.get(topic)
        if alias is not None:
            by_topic.move_to_end(topic)
            self.used += 1
            named = b""
        else:
            named = topic
            if len(data) + 4 > max_packet_size > 0:  # the alias property, and a longer length maybe
                return data
            if len(by_topic) < self.maximum:
                alias = len(by_topic) + 1
            else:
                _, alias = by_topic.popitem(last=False)
            by_topic[topic] = alias
            self.set += 1
        props = data[props_start:props_end] + bytes((_TOPIC_ALIAS, alias >> 8, alias & 0xFF))
        body = b"".join(
            (
                _H.pack(len(named)),
                named,
                data[pos + 2 + topic_length : after_topic],  # the packet id, if any
                pack_varint(len(props)),
                props,
                data[props_end:end],
            )
        )
        out = encode_frame(first, body)
        self.saved += len(data) - len(out)
        return out
