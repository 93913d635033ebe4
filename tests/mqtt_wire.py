"""Reading what the server writes, for sans-IO tests: PUBLISH has the same format in
both directions, so the server's own reader parses the packets it sends."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from servers.heartbeat.mqtt.packets import Publish
from servers.heartbeat.mqtt.reader import PacketReader


@dataclass(frozen=True)
class Sent:
    """A PUBLISH the server wrote (``packet_id`` 0 at QoS 0)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int


def parse_server_packets(chunks: Iterable[bytes]) -> list[Sent]:
    """The PUBLISH packets in ``chunks``, in order (anything else is an error)."""
    out: list[Sent] = []
    for packet in PacketReader(1 << 20).feed(b"".join(chunks)):
        assert isinstance(packet, Publish), packet
        out.append(Sent(packet.topic, packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id or 0))
    return out
