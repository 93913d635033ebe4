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

from collections import OrderedDict

from .wire import pack_varint, read_varint

__all__ = ["MIN_TOPIC", "OutboundAliases"]

MIN_TOPIC = 4
"""Topics shorter than this many bytes are never aliased (an alias costs three)."""

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
        # Every length read inline when it is one byte (nearly always): this runs for
        # each message to each such client, beside an encode that costs about as much.
        pos = 2 if data[1] < 0x80 else read_varint(data, 1, len(data))[1]
        start = pos + 2
        topic_end = start + (data[pos] << 8 | data[pos + 1])
        if topic_end - start < MIN_TOPIC:
            return data
        topic = data[start:topic_end]
        after = topic_end + 2 if first & 0x06 else topic_end
        if data[after] < 0x80:
            props_length, props_start = data[after], after + 1
        else:
            props_length, props_start = read_varint(data, after, len(data))
        by_topic = self._by_topic
        alias = by_topic.get(topic)
        if alias is not None:
            by_topic.move_to_end(topic)
            self.used += 1
            head = b"\x00\x00"  # the topic, empty: the alias names it
        else:
            if len(data) + 4 > max_packet_size > 0:  # the alias property, and a longer length maybe
                return data
            if len(by_topic) < self.maximum:
                alias = len(by_topic) + 1
            else:
                _, alias = by_topic.popitem(last=False)
            by_topic[topic] = alias
            self.set += 1
            head = data[pos:topic_end]
        props_end = props_start + props_length
        body = b"".join(
            (
                head,
                data[topic_end:after],  # the packet id, if any
                bytes((props_length + 3,)) if props_length < 125 else pack_varint(props_length + 3),
                data[props_start:props_end],
                bytes((_TOPIC_ALIAS, alias >> 8, alias & 0xFF)),
                data[props_end:],
            )
        )
        n = len(body)
        out = bytes((first, n)) + body if n < 0x80 else bytes((first,)) + pack_varint(n) + body
        self.saved += len(data) - len(out)
        return out
