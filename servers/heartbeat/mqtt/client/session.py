"""An MQTT client's side of one remote broker, sans-IO, for 3.1.1 and 5.0.

:class:`ClientSession` is what a bridge holds for the broker it connects to: it writes
the CONNECT, reads what comes back (:meth:`~ClientSession.receive_data` returns
:mod:`.events`), answers the remote's QoS 1 and 2 messages itself, and keeps its own
outbound QoS 1 and 2 messages until they are done, through any number of network
connections. Every call only queues bytes; :meth:`~ClientSession.bytes_to_send` hands
them over. The driver owns the socket and the clock: it calls :meth:`~ClientSession.connect`
for each new connection and :meth:`~ClientSession.ping` on its keep-alive timer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .. import encoders
from ..packets import ProtocolError
from ..v5 import codec as v5_codec
from ..v5 import packets as v5
from ..v5.properties import EMPTY, Properties
from ..v5.reason_codes import PacketError, ReasonCode, protocol_error
from . import events
from .options import ClientOptions, encode_connect
from .outbox import Outbox, Outgoing
from .reader import ServerPacketReader

__all__ = ["IDLE", "CONNECTING", "CONNECTED", "CLOSED", "ClientSession"]

IDLE, CONNECTING, CONNECTED, CLOSED = "idle", "connecting", "connected", "closed"

# 3.1.1's CONNACK refusals (3.2.2.3), as labels like 5.0's.
_REFUSALS_V3 = {
    1: "unacceptable-protocol-version",
    2: "identifier-rejected",
    3: "server-unavailable",
    4: "bad-username-or-password",
    5: "not-authorized",
}


def _label(code: int) -> str:
    try:
        return ReasonCode(code).label
    except ValueError:
        return f"reason-{code:#04x}"


class ClientSession:
    """One client's MQTT session with a remote broker (see the module's docstring).

    ``state`` is :data:`IDLE` before the first :meth:`connect`, :data:`CONNECTING`
    until the CONNACK, :data:`CONNECTED`, then :data:`CLOSED` once the connection is
    over for the protocol (refused, DISCONNECT either way, a violation). Whatever the
    state, messages not yet done wait for the next connection.
    """

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.state = IDLE
        self.keep_alive = options.keep_alive
        """Seconds between PINGREQs at most: ours, or the remote's Server Keep Alive (5.0)."""
        self.client_id = options.client_id
        """Ours, or the one a 5.0 remote assigned for an empty one (the next CONNECT uses it)."""
        self._v5 = options.v5
        self._out = bytearray()
        self._events: list[events.Event] = []
        self._reader = ServerPacketReader(self._v5, options.largest_inbound)
        self._outbox = Outbox(options.window)
        # Inbound QoS 2 packet ids answered with PUBREC and not yet released: a PUBLISH
        # with one of them is a resend, answered but not delivered again.
        self._incoming: set[int] = set()
        # manual_ack: the inbound QoS 1/2 messages delivered and not yet acknowledged by
        # the caller, by packet id; the very event object, so that an acknowledgement
        # meant for a message of an earlier connection never answers a later one that
        # happens to reuse its packet id.
        self._unacked: dict[int, events.Message] = {}
        self._aliases: dict[int, str] = {}
        self._remote_max_packet: int | None = None
        self._remote_max_qos = 2
        self._remote_retain = True

    # -- the connection ---------------------------------------------------------------

    def connect(self) -> None:
        """Start a new network connection: queue its CONNECT. What the last connection
        left half-read, its topic aliases and its pending SUBSCRIBEs are gone; the
        messages stay, for the CONNACK to decide how they go again."""
        self._reader = ServerPacketReader(self._v5, self.options.largest_inbound)
        self._aliases.clear()
        self._outbox.requests.clear()
        # Messages delivered and not yet acknowledged are the remote's to send again
        # (with its session) or lost with it (without): either way this connection's
        # acknowledgement of them is moot, and a QoS 2 one sent again must be delivered
        # again, since nothing answered it.
        self._incoming.difference_update(self._unacked)
        self._unacked.clear()
        self._out.clear()
        options = self.options
        if self.client_id != options.client_id:
            options = dataclasses.replace(options, client_id=self.client_id)
        self._out += encode_connect(options)
        self.state = CONNECTING

    def disconnect(self, reason_code: int = 0, properties: Properties = EMPTY) -> None:
        """Queue a DISCONNECT (5.0: with ``reason_code`` and ``properties``); the session is
        then :data:`CLOSED` until the next :meth:`connect`."""
        if self.state in (CONNECTING, CONNECTED):
            self._out += v5_codec.pack(v5.Disconnect(reason_code, properties)) if self._v5 else b"\xe0\x00"
        self.state = CLOSED

    def ping(self) -> None:
        """Queue a PINGREQ (its PINGRESP comes back as :class:`~.events.Pong`)."""
        self._require_connection("ping")
        self._out += encoders.encode_pingreq()

    def bytes_to_send(self) -> bytes:
        """Everything queued for the remote since the last call, in order."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def pending_events(self) -> list[events.Event]:
        """Events that came of a call rather than of received bytes (a message
        :meth:`publish` had to drop), and are not yet returned by :meth:`receive_data`."""
        out, self._events = self._events, []
        return out

    @property
    def in_flight(self) -> int:
        """QoS 1/2 messages sent and not yet done."""
        return len(self._outbox.inflight)

    @property
    def queued(self) -> int:
        """Messages waiting for a connection or for room in the window."""
        return len(self._outbox.queue)

    @property
    def unfinished(self) -> list[int]:
        """The tokens of every message not yet done, in flight first, in order."""
        return [message.token for message in self._outbox]

    # -- what we send ---------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, properties: Properties | None = None
    ) -> int:
        """Send a message now if the connection and the window allow, else queue it;
        return its token (QoS 1 and 2 are reported :class:`~.events.Acknowledged` by it).
        A topic alias in ``properties`` is dropped: this client never sets one."""
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS {qos}")
        if not topic or "+" in topic or "#" in topic:
            raise ValueError(f"not a topic name: {topic[:64]!r}")
        props = properties or EMPTY
        if props.topic_alias is not None:
            props = props.replace(topic_alias=None)
        message = self._outbox.new(topic, payload, qos, retain, props)
        if self.state == CONNECTED and (not qos or (self._outbox.room and not self._outbox.queue)):
            self._send_new(message)
        else:
            self._outbox.queue.append(message)
        return message.token

    def subscribe(self, filters: Sequence[tuple[str, int] | v5.Subscription], properties: Properties = EMPTY) -> int:
        """Queue a SUBSCRIBE; return its packet id (its SUBACK comes back as
        :class:`~.events.Subscribed`). A 5.0 :class:`~..v5.packets.Subscription` carries
        No Local, Retain As Published and Retain Handling; 3.1.1 sends its QoS only."""
        self._require_connection("subscribe")
        subs = tuple(f if isinstance(f, v5.Subscription) else v5.Subscription(f[0], f[1]) for f in filters)
        if not subs:
            raise ValueError("a SUBSCRIBE names at least one filter")
        packet_id = self._outbox.allocate()
        if self._v5:
            self._out += v5_codec.pack(v5.Subscribe(packet_id, subs, properties))
        else:
            self._out += encoders.encode_subscribe(packet_id, [(s.topic_filter, s.qos) for s in subs])
        self._outbox.requests[packet_id] = len(subs)
        return packet_id

    def unsubscribe(self, filters: Sequence[str], properties: Properties = EMPTY) -> int:
        """Queue an UNSUBSCRIBE; return its packet id (:class:`~.events.Unsubscribed`)."""
        self._require_connection("unsubscribe")
        if not filters:
            raise ValueError("an UNSUBSCRIBE names at least one filter")
        packet_id = self._outbox.allocate()
        if self._v5:
            self._out += v5_codec.pack(v5.Unsubscribe(packet_id, tuple(filters), properties))
        else:
            self._out += encoders.encode_unsubscribe(packet_id, filters)
        self._outbox.requests[packet_id] = len(filters)
        return packet_id

    def acknowledge(self, message: events.Message) -> bool:
        """With ``manual_ack``: answer ``message`` (a QoS 1 or 2 :class:`~.events.Message`
        this session delivered) now, PUBACK or PUBREC. Returns whether it was answered:
        not when it came on an earlier connection (the remote sends it again, or lost
        it with its session), nor when already answered, nor at QoS 0."""
        if self._unacked.get(message.packet_id) is not message or self.state != CONNECTED:
            return False
        del self._unacked[message.packet_id]
        self._ack(v5.PUBACK if message.qos == 1 else v5.PUBREC, message.packet_id)
        return True

    def _require_connection(self, what: str) -> None:
        if self.state not in (CONNECTING, CONNECTED):
            raise RuntimeError(f"cannot {what} while {self.state}")

    def _encode_publish(self, message: Outgoing, dup: bool) -> bytes:
        qos = message.qos
        retain = message.retain and self._remote_retain
        if self._v5:
            packet = v5.Publish(message.topic, message.payload, qos, retain, dup, message.packet_id, message.properties)
            return v5_codec.pack(packet)
        return encoders.encode_publish(message.topic, message.payload, qos, retain, message.packet_id, dup)

    def _send_new(self, message: Outgoing) -> None:
        """Send ``message`` for the first time on this connection (the window has room)."""
        # A remote's Maximum QoS (5.0) caps what it takes (MQTT-3.2.2-11): the message
        # goes at the QoS it allows, as Mosquitto's bridge sends it, and keeps that QoS.
        asked, qos = message.qos, min(message.qos, self._remote_max_qos)
        message.qos = qos
        if qos:
            self._outbox.fly(message, self._outbox.allocate())
        wire = self._encode_publish(message, dup=False)
        if self._remote_max_packet is not None and len(wire) > self._remote_max_packet:
            # MQTT-3.1.2-24: never sent; the message is done as if it had been.
            if qos:
                self._outbox.done(message.packet_id or 0)
            self._events.append(events.Dropped(message.token, "packet-too-large"))
            return
        self._out += wire
        if asked and not qos:
            # Sent at QoS 0 because the remote takes no more: no acknowledgement will
            # come, so it is done once written.
            self._events.append(events.Acknowledged(message.token))

    def _drain(self) -> None:
        """Send what the queue holds while the window has room, in order."""
        outbox = self._outbox
        while outbox.queue and (outbox.room or not outbox.queue[0].qos):
            self._send_new(outbox.queue.popleft())

    def _ack(self, kind: int, packet_id: int, code: int = 0) -> None:
        # Without a reason code a 5.0 acknowledgement is the 3.1.1 one, byte for byte.
        self._out += v5_codec.pack(v5.Ack(kind, packet_id, code))

    # -- what we receive ----------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[events.Event]:
        """Take bytes from the remote; return what they meant, in order (after any
        :meth:`pending_events`). Answers are queued for :meth:`bytes_to_send`. A
        violation ends the connection: a :class:`~.events.ProtocolViolation` is the
        last event, and later bytes are ignored until the next :meth:`connect`."""
        if self.state in (CONNECTING, CONNECTED) and data:
            try:
                for packet in self._reader.feed(data):
                    self._handle(packet)
                    if self.state not in (CONNECTING, CONNECTED):
                        break
            except ProtocolError as exc:
                self._violation(exc)
        return self.pending_events()

    def _violation(self, exc: ProtocolError) -> None:
        code = None
        if self._v5:
            code = int(exc.code) if isinstance(exc, PacketError) else int(ReasonCode.MALFORMED_PACKET)
            self._out += v5_codec.pack(v5.Disconnect(code))
        self.state = CLOSED
        self._events.append(events.ProtocolViolation(exc.reason, exc.detail, code))

    def _handle(self, packet: v5.Packet) -> None:
        if isinstance(packet, v5.Connack):
            self._connack(packet)
            return
        if self.state != CONNECTED:
            raise protocol_error(f"{type(packet).__name__} before the CONNACK")
        if isinstance(packet, v5.Publish):
            self._publish(packet)
        elif isinstance(packet, v5.Ack):
            self._acknowledgement(packet)
        elif isinstance(packet, (v5.Suback, v5.Unsuback)):
            self._request_done(packet)
        elif isinstance(packet, v5.Pingresp):
            self._events.append(events.Pong())
        elif isinstance(packet, v5.Disconnect):
            self.state = CLOSED
            self._events.append(events.Disconnected(packet.reason_code, packet.properties))
        else:  # AUTH: this client asks for no enhanced authentication
            raise protocol_error(f"{type(packet).__name__} from the server")

    def _connack(self, packet: v5.Connack) -> None:
        if self.state != CONNECTING:
            raise protocol_error("a second CONNACK")
        code = packet.reason_code
        if code >= 0x80 or (code and not self._v5):
            self.state = CLOSED
            label = _label(code) if self._v5 else _REFUSALS_V3.get(code, "refused")
            self._events.append(events.Refused(code, label))
            return
        if packet.session_present and self.options.clean:
            raise protocol_error("session present after a clean start")  # MQTT-3.2.2-1, MQTT-3.2.2-2
        props = packet.properties
        self._remote_max_packet = props.maximum_packet_size
        self._remote_max_qos = 2 if props.maximum_qos is None else props.maximum_qos
        self._remote_retain = props.retain_available != 0
        window = self.options.window
        if props.receive_maximum is not None:
            window = min(window, props.receive_maximum)
        self._outbox.window = window
        self.keep_alive = self.options.keep_alive if props.server_keep_alive is None else props.server_keep_alive
        if props.assigned_client_identifier is not None:
            self.client_id = props.assigned_client_identifier
        self.state = CONNECTED
        self._events.append(events.Connected(packet.session_present, code, props))
        if packet.session_present:
            # The remote kept the session: every message in flight goes again, in its
            # order, as the remote last knew it (MQTT-4.4.0-1).
            for message in self._outbox.inflight.values():
                if message.released:
                    self._ack(v5.PUBREL, message.packet_id or 0)
                else:
                    self._out += self._encode_publish(message, dup=True)
        else:
            # No session there (a clean start, or the remote restarted without its
            # store): it knows none of our packet ids and holds none of its own
            # for us. Even a message it had PUBRECed goes again as new: a broker that
            # delivers on PUBREL, as Mosquitto does, lost it with the session.
            self._incoming.clear()
            self._outbox.forget_flight()
        self._drain()

    def _publish(self, packet: v5.Publish) -> None:
        topic, props = packet.topic, packet.properties
        alias = props.topic_alias
        if alias is not None:
            if alias > self.options.topic_alias_maximum or not self._v5:
                raise PacketError(ReasonCode.TOPIC_ALIAS_INVALID, f"topic alias {alias}")
            if topic:
                self._aliases[alias] = topic
            elif (topic := self._aliases.get(alias, "")) == "":
                raise protocol_error(f"topic alias {alias} was never set")
            props = props.replace(topic_alias=None)
        packet_id = packet.packet_id or 0
        message = events.Message(topic, packet.payload, packet.qos, packet.retain, props, packet_id)
        if packet.qos and self.options.manual_ack:
            self._deliver_unanswered(message)
        elif packet.qos == 1:
            self._events.append(message)
            self._ack(v5.PUBACK, packet_id)
        elif packet.qos == 2:
            if packet_id not in self._incoming:
                limit = self.options.receive_maximum
                if self._v5 and limit is not None and len(self._incoming) >= limit:
                    raise PacketError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED, f"more than {limit} QoS 2 messages")
                self._incoming.add(packet_id)
                self._events.append(message)
            self._ack(v5.PUBREC, packet_id)
        else:
            self._events.append(message)

    def _deliver_unanswered(self, message: events.Message) -> None:
        """manual_ack: deliver ``message``, leaving its answer to :meth:`acknowledge`."""
        packet_id = message.packet_id
        if packet_id in self._unacked:
            return  # a resend of one still waiting for the caller: it is answered once
        if message.qos == 2 and packet_id in self._incoming:
            self._ack(v5.PUBREC, packet_id)  # answered already: the PUBREC went missing
            return
        if message.qos == 2:
            limit = self.options.receive_maximum
            if self._v5 and limit is not None and len(self._incoming) >= limit:
                raise PacketError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED, f"more than {limit} QoS 2 messages")
            self._incoming.add(packet_id)
        self._unacked[packet_id] = message
        self._events.append(message)

    def _acknowledgement(self, packet: v5.Ack) -> None:
        kind, packet_id = packet.kind, packet.packet_id
        if kind == v5.PUBREL:
            known = packet_id in self._incoming
            self._incoming.discard(packet_id)
            # 5.0 says when the id was unknown; 3.1.1 answers the same either way.
            code = 0 if known or not self._v5 else int(ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)
            self._ack(v5.PUBCOMP, packet_id, code)
            return
        message = self._outbox.inflight.get(packet_id)
        if message is None:
            # An answer to a packet this session no longer holds: a duplicate (a PUBREC
            # answered twice, an ack of a resend that crossed the first's): no news.
            return
        qos = message.qos
        if (kind == v5.PUBACK and qos == 1) or (kind == v5.PUBCOMP and qos == 2 and message.released):
            self._finish(packet_id, packet.reason_code)
        elif kind == v5.PUBREC and qos == 2:
            if packet.reason_code >= 0x80:
                self._finish(packet_id, packet.reason_code)  # refused: no PUBREL follows
            else:
                message.released = True
                self._ack(v5.PUBREL, packet_id)
        else:
            name = {v5.PUBACK: "PUBACK", v5.PUBREC: "PUBREC", v5.PUBCOMP: "PUBCOMP"}[kind]
            raise protocol_error(f"{name} for packet {packet_id}, a QoS {qos} message")

    def _finish(self, packet_id: int, code: int) -> None:
        message = self._outbox.done(packet_id)
        self._events.append(events.Acknowledged(message.token, code))
        self._drain()

    def _request_done(self, packet: v5.Suback | v5.Unsuback) -> None:
        expected = self._outbox.requests.pop(packet.packet_id, None)
        is_suback = isinstance(packet, v5.Suback)
        name = "SUBACK" if is_suback else "UNSUBACK"
        if expected is None:
            raise protocol_error(f"{name} for packet {packet.packet_id}, which asked for nothing")
        if (is_suback or self._v5) and len(packet.reason_codes) != expected:
            raise protocol_error(f"{name} with {len(packet.reason_codes)} codes for {expected} filters")
        if is_suback:
            self._events.append(events.Subscribed(packet.packet_id, packet.reason_codes))
        else:
            self._events.append(events.Unsubscribed(packet.packet_id, packet.reason_codes))
