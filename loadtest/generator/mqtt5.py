"""What an MQTT 5.0 device sends and how it reads the server's answers, sans-IO.

The packets are written and read by the server's own 5.0 codec
(:mod:`servers.heartbeat.mqtt.v5.codec`), so that the load tools and the server speak one
reading of the spec. A device's CONNECT asks for no session after the connection
(Session Expiry 0) and says how many QoS 1 and 2 messages it takes at once (Receive
Maximum). The server's answer to it is one of:

- a 5.0 CONNACK: accepted (reason code 0x00, maybe with a Server Keep Alive the device
  must then ping at) or refused (its reason code);
- a 3.x CONNACK (``20 02 00 rc``): a server that does not serve 5.0 refuses it so,
  with rc 1, "unacceptable protocol version";
- a DISCONNECT, or something else: counted as a refusal by what it was.

Once online, what the server sends is PINGRESPs, and perhaps a DISCONNECT with a
reason code before it closes (keep-alive timeout, session taken over, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from servers.heartbeat.mqtt.v5.codec import pack, read_packet
from servers.heartbeat.mqtt.v5.packets import Connack, Connect, Disconnect
from servers.heartbeat.mqtt.v5.properties import Properties
from servers.heartbeat.mqtt.v5.reason_codes import PacketError, ReasonCode

from ..mqtt_frames import frames

__all__ = [
    "RECEIVE_MAXIMUM",
    "Answer",
    "disconnect_reasons",
    "encode_connect",
    "read_connack",
    "reason_label",
]

RECEIVE_MAXIMUM = 32
"""The QoS 1 and 2 messages a device takes at once (the spec's default is 65,535)."""
_DISCONNECT = 0xE
_CONNECT_PROPERTIES = Properties(session_expiry_interval=0, receive_maximum=RECEIVE_MAXIMUM)


def encode_connect(client_id: str, keepalive: int) -> bytes:
    """A device's 5.0 CONNECT: Clean Start, Session Expiry 0, a Receive Maximum, no credentials."""
    return pack(Connect(client_id, keepalive, clean_start=True, properties=_CONNECT_PROPERTIES))


def reason_label(code: int) -> str:
    """A reason code as reports write it: ``0x8D keep-alive-timeout``."""
    try:
        return f"0x{code:02X} {ReasonCode(code).label}"
    except ValueError:
        return f"0x{code:02X} unknown"


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer to a 5.0 CONNECT."""

    accepted: bool
    label: str
    """What it was: ``5.0 CONNACK 0x00 success``, ``3.x CONNACK 1``, ``DISCONNECT 0x81 ...``."""
    server_keep_alive: int | None
    """The CONNACK's Server Keep Alive: the keep-alive the device must use instead of its own."""
    used: int
    """Bytes of the buffer the answer took."""


def read_connack(buf: bytes | bytearray) -> Answer | None:
    """The server's answer at the start of ``buf``, once its first packet is whole (None before)."""
    try:
        found, _ = frames(buf)
    except ValueError:
        return Answer(False, "malformed remaining length", None, len(buf))
    if not found:
        return None
    first, start, end = found[0]
    body = bytes(buf[start:end])
    if first == 0x20 and len(body) == 2:
        # No property length: a 3.1.1 (or 3.1) server's CONNACK.
        return Answer(False, f"3.x CONNACK {body[1]}", None, end)
    try:
        packet = read_packet(first, body)
    except PacketError as exc:
        return Answer(False, f"malformed answer: {exc.code.label}", None, end)
    if isinstance(packet, Connack):
        label = f"5.0 CONNACK {reason_label(packet.reason_code)}"
        if packet.reason_code:
            return Answer(False, label, None, end)
        return Answer(True, label, packet.properties.server_keep_alive, end)
    if isinstance(packet, Disconnect):
        return Answer(False, f"DISCONNECT {reason_label(packet.reason_code)}", None, end)
    return Answer(False, f"{type(packet).__name__.upper()} before CONNACK", None, end)


def disconnect_reasons(buf: bytes | bytearray) -> tuple[list[str], int]:
    """The reason of each DISCONNECT among the whole packets at the start of ``buf`` (a
    label, as :func:`reason_label` writes it), and how many bytes those packets take.
    Other packets (PINGRESPs) are passed over; a DISCONNECT that does not parse is
    ``malformed DISCONNECT``, a remaining length that does not parse takes the buffer."""
    try:
        found, used = frames(buf)
    except ValueError:
        return ["malformed remaining length"], len(buf)
    out = []
    for first, start, end in found:
        if first >> 4 != _DISCONNECT:
            continue
        try:
            packet = read_packet(first, bytes(buf[start:end]))
        except PacketError:
            out.append("malformed DISCONNECT")
            continue
        assert isinstance(packet, Disconnect)
        out.append(reason_label(packet.reason_code))
    return out, used
