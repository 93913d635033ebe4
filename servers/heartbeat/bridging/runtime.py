"""A bridge running (:class:`Bridge`): two client sessions, one to this server's own
listener over loopback (the *local* side) and one to the remote broker, and the
messages and acknowledgements passed between them.

- Out: a local message on an ``out``/``both`` topic is published to the remote on its
  mapped topic, at its QoS (the local subscription was made at the topic's QoS, so
  the broker already delivered it at no more); a QoS 1/2 one is acknowledged to the
  local broker only once the remote acknowledged its copy. Until then the local broker
  holds it, and what it holds beyond the bridge's window of messages in flight, with
  the bridge's persistent session: nothing is lost while the remote is away or
  restarting. A QoS 0 one is dropped while the remote is away, as QoS 0 may be.
- In: a remote message on an ``in``/``both`` topic is published locally on its mapped
  topic, and acknowledged to the remote once the local broker acknowledged it.
- Retained: on each connection to the remote, as Mosquitto's bridge, the local
  retained messages of the out topics go to it (the local subscription is made again
  with Retain Handling 0), the registry's presence among them: after any outage the
  remote's retained view is the edge's.
- Loops: the local subscriptions take No Local (5.0), so what the bridge publishes
  locally never comes back to it; on the remote, a 5.0 bridge's subscriptions take No
  Local too, and a 3.1.1 one marks its CONNECT as a bridge's (``try_private``), which
  Mosquitto honours the same way.
- The remote's connection is watched by the worker's keeper: nothing received for
  1.5 keep-alive intervals (a PINGREQ goes every interval) ends it, and the bridge
  connects again after ``restart_timeout``'s wait, trying the addresses in turn.
- Notifications, as Mosquitto's: ``1`` retained on the notification topic once
  connected, ``0`` when not (locally at start and on each loss; on the remote through
  the CONNECT's Will), each on the remote too unless ``notifications_local_only``.
"""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Callable

import trio

import idlekeeper

from ..bridge import BridgeAddress, BridgeSpec
from ..bridge.topics import (
    local_subscriptions,
    map_incoming,
    map_outgoing,
    remote_subscriptions,
    remote_unsubscriptions,
)
from ..mqtt.client import (
    CONNECTED,
    MQTT_50,
    MQTT_311,
    Acknowledged,
    ClientOptions,
    ClientSession,
    Connected,
    Disconnected,
    Dropped,
    Event,
    Message,
    ProtocolViolation,
    Refused,
    Subscribed,
)
from ..mqtt.v5 import packets as v5
from ..mqtt.v5.properties import Properties
from .side import Side, open_remote, tls_context

__all__ = ["LOCAL_SESSION_EXPIRY", "WINDOW", "Bridge"]

log = logging.getLogger("servers.heartbeat.bridge")

LOCAL_SESSION_EXPIRY = 0xFFFFFFFF
"""The local session's (and a persistent 5.0 remote one's) Session Expiry: never, so
that the broker keeps the bridge's messages however long the bridge is away."""
WINDOW = 20
"""QoS 1/2 messages in flight each way at most: the bridge's Receive Maximum on both
sides and its own window, so that what waits beyond it waits in the brokers."""
LOCAL_KEEP_ALIVE = 60
"""The local side's keep-alive: the server's own loopback, watched like the remote."""
LOCAL_RETRY = 1.0
"""Seconds before connecting to the local listener again after losing it."""


class Bridge:
    """One bridge (``spec``) between this server's listener on ``local_host:local_port``
    and the remote broker, its connections watched by ``keeper``. :meth:`run` runs it
    until cancelled. ``hostname`` makes the default client ids (the machine's name by
    default); ``uniform`` draws the backoff's jitter (:func:`random.uniform`).
    ``announce(topic, payload)`` publishes the local notifications as the server's own
    (retained); None: through the local session, which a ``$`` topic (the default
    notification topic) does not pass, since a client may not publish there."""

    def __init__(
        self,
        spec: BridgeSpec,
        local_port: int,
        keeper: idlekeeper.Keeper,
        *,
        local_host: str = "127.0.0.1",
        hostname: str | None = None,
        uniform: Callable[[float, float], float] = random.uniform,
        announce: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.spec = spec
        self.keeper = keeper
        self.local_address = BridgeAddress(local_host, local_port)
        self._uniform = uniform
        self._announce = announce
        self.state_topic = spec.notification(hostname)
        version = MQTT_50 if spec.bridge_protocol_version == "mqttv50" else MQTT_311
        self._remote_v5 = version == MQTT_50
        remote_will = None
        if spec.notifications and not spec.notifications_local_only:
            remote_will = v5.Will(self.state_topic, b"0", 1, True)
        self.local = Side(
            "local",
            ClientSession(
                ClientOptions(
                    spec.local_id(hostname),
                    MQTT_50,
                    clean=spec.local_clean,
                    keep_alive=LOCAL_KEEP_ALIVE,
                    username=spec.local_username,
                    password=_bytes(spec.local_password),
                    session_expiry=None if spec.local_clean else LOCAL_SESSION_EXPIRY,
                    receive_maximum=WINDOW,
                    window=WINDOW,
                    manual_ack=True,
                )
            ),
        )
        self.remote = Side(
            "remote",
            ClientSession(
                ClientOptions(
                    spec.remote_id(hostname),
                    version,
                    clean=spec.cleansession,
                    keep_alive=spec.keepalive_interval,
                    username=spec.remote_username,
                    password=_bytes(spec.remote_password),
                    will=remote_will,
                    session_expiry=None if spec.cleansession or not self._remote_v5 else LOCAL_SESSION_EXPIRY,
                    receive_maximum=WINDOW if self._remote_v5 else None,
                    maximum_packet_size=spec.bridge_max_packet_size or None,
                    window=WINDOW,
                    try_private=spec.try_private and not self._remote_v5,
                    manual_ack=True,
                )
            ),
        )
        self._context: ssl.SSLContext | None = tls_context(spec) if spec.tls else None
        # Chained acknowledgements: a message's copy's token on one side -> the message
        # as it came from the other side, answered when the copy is.
        self._out: dict[int, Message] = {}
        self._in: dict[int, Message] = {}
        self._local_ready = trio.Event()
        self._notified_start = False
        self._refused = False
        self.attempts = 0
        """Connections to the remote tried."""
        self.connections = 0
        """Connections to the remote the remote accepted."""
        self.forwarded_out = 0
        self.forwarded_in = 0

    # -- running -------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the bridge until cancelled; ``started`` once the local side is subscribed
        (the remote side then connects in the background)."""
        if self.spec.start_type != "automatic":
            log.warning("bridge %s: start_type %s runs as automatic here", self.spec.name, self.spec.start_type)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._local_loop)
            await self._local_ready.wait()
            task_status.started()
            await self._remote_loop()

    async def _local_loop(self) -> None:
        while True:
            try:
                with trio.fail_after(LOCAL_KEEP_ALIVE):
                    stream = await trio.open_tcp_stream(self.local_address.host, self.local_address.port)
            except (OSError, trio.TooSlowError) as exc:
                log.warning("bridge %s: the local listener %s: %s", self.spec.name, self.local_address.text(), exc)
            else:
                await self._converse(self.local, stream)
                log.warning("bridge %s: the local connection ended", self.spec.name)
            await trio.sleep(LOCAL_RETRY)

    async def _remote_loop(self) -> None:
        addresses = self.spec.addresses
        index = 0
        delay = float(self.spec.restart_timeout.base)
        while True:
            address = addresses[index % len(addresses)]
            held = await self._attempt(address)
            if held:
                # Mosquitto's order: after a connection that held, the main address
                # first again (unless round robin), and the backoff from its base.
                index = index + 1 if self.spec.round_robin else 0
                delay = float(self.spec.restart_timeout.base)
            else:
                index += 1
                delay = self.spec.restart_timeout.next_delay(delay, self._uniform)
            await trio.sleep(delay)

    async def _attempt(self, address: BridgeAddress) -> bool:
        """One connection to the remote; whether the remote accepted it."""
        self.attempts += 1
        where = address.text()
        try:
            with trio.fail_after(self.spec.keepalive_interval):
                stream = await open_remote(self.spec, address, self._context)
        except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.warning("bridge %s: cannot connect to %s: %s", self.spec.name, where, _why(exc))
            return False
        connections = self.connections
        self._refused = False
        expired = await self._converse(self.remote, stream)
        held = self.connections > connections
        if not held and not self._refused:
            # Connected, and no CONNACK came (a remote that accepts sockets and answers
            # nothing, as a stopped process does): said once for the attempt too.
            how = "no answer to the CONNECT" if expired else "closed before its CONNACK"
            log.warning("bridge %s: %s: %s", self.spec.name, where, how)
        if held:
            self._notify_local(b"0")
            await self.local.flush()
            if expired:
                log.warning(
                    "bridge %s: %s stopped answering (nothing for %.0f s)",
                    self.spec.name,
                    where,
                    1.5 * self.remote.session.keep_alive,
                )
            else:
                log.warning("bridge %s: the connection to %s ended", self.spec.name, where)
        return held

    async def _converse(self, side: Side, stream: trio.abc.Stream) -> bool:
        """Hold one connection of ``side`` until it ends; whether it ended by the
        keeper's receive deadline."""
        keep_alive = side.session.options.keep_alive
        receive = 1.5 * keep_alive if keep_alive else None
        conn = self.keeper.watch(stream, receive=receive)
        assert isinstance(conn, idlekeeper.WatchedStream)
        with conn:
            side.stream = side.watch = conn
            side.session.connect()
            await side.flush()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ping, side)
                    await self._read(side, conn)
                    nursery.cancel_scope.cancel()
            finally:
                side.stream = side.watch = None
                side.up = False
        await trio.aclose_forcefully(conn)
        return conn.expired

    async def _ping(self, side: Side) -> None:
        while True:
            keep_alive = side.session.keep_alive
            if not keep_alive:
                await trio.sleep_forever()
            await trio.sleep(keep_alive)
            if side.session.state == CONNECTED:
                side.session.ping()
                await side.flush()

    async def _read(self, side: Side, stream: trio.abc.Stream) -> None:
        while True:
            try:
                data = await stream.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            # A whole read's events are handled before anything is sent, so that a burst
            # of messages goes on in one write each way rather than one per message.
            going = self._handle(side, side.session.receive_data(data))
            await self.remote.flush()
            await self.local.flush()
            if not going:
                return

    # -- events --------------------------------------------------------------------------

    def _handle(self, side: Side, events: list[Event]) -> bool:
        """Act on ``side``'s events, queueing what they answer on both sessions (the
        caller sends it); False once its connection is over."""
        local = side is self.local
        for event in events:
            if isinstance(event, Message):
                if local:
                    self._outgoing(event)
                else:
                    self._incoming(event)
            elif isinstance(event, (Acknowledged, Dropped)):
                chained, origin = (self._in, self.remote) if local else (self._out, self.local)
                message = chained.pop(event.token, None)
                if message is not None:
                    origin.session.acknowledge(message)
            elif isinstance(event, Connected):
                side.up = True
                if side.watch is not None and side.session.keep_alive:
                    # A 5.0 server may set its own keep-alive (Server Keep Alive): the
                    # PINGREQs follow it, and so does the deadline for its answers.
                    side.watch.receive_timeout = 1.5 * side.session.keep_alive
                if local:
                    self._local_connected()
                else:
                    self._remote_connected()
            elif isinstance(event, Subscribed):
                if local:
                    self._local_ready.set()
                failed = [code for code in event.codes if code >= 0x80]
                if failed:
                    name = self.spec.name
                    log.warning("bridge %s: the %s broker refused a subscription: %s", name, side.name, failed)
            elif isinstance(event, Refused):
                self._refused = self._refused or not local
                log.warning(
                    "bridge %s: the %s broker refused the connection: %s (%d)",
                    self.spec.name,
                    side.name,
                    event.reason,
                    event.code,
                )
                return False
            elif isinstance(event, (Disconnected, ProtocolViolation)):
                log.warning("bridge %s: the %s broker's connection ended: %s", self.spec.name, side.name, event)
                return False
        return True

    def _local_connected(self) -> None:
        # As Mosquitto's bridge: the local broker's retained messages on the out topics
        # go to the remote on each connection to it, so its retained view is the
        # edge's after every outage (presence above all). So this subscription asks
        # for them only if the remote is already up; else _remote_connected does.
        self._subscribe_locally(0 if self.remote.up else 2)
        if self.spec.notifications and not self._notified_start:
            # As Mosquitto: the state is "0" from the start, until the remote accepts.
            self._notified_start = True
            self._notify_local(b"0")

    def _subscribe_locally(self, retain_handling: int) -> None:
        # Retain As Published: a retained message goes on retained (bridge_outgoing_retain
        # says whether), as Mosquitto's bridge, inside its broker, sees the flag.
        subs = [
            v5.Subscription(f, q, no_local=True, retain_as_published=True, retain_handling=retain_handling)
            for f, q in local_subscriptions(self.spec.topics)
        ]
        if subs:
            self.local.session.subscribe(subs)
        else:
            self._local_ready.set()  # an ``in``-only bridge listens to nothing here

    def _remote_connected(self) -> None:
        self.connections += 1
        session = self.remote.session
        log.info("bridge %s: connected (%d)", self.spec.name, self.connections)
        if self.spec.bridge_attempt_unsubscribe and (gone := remote_unsubscriptions(self.spec.topics)):
            session.unsubscribe(gone)
        wanted = remote_subscriptions(self.spec.topics)
        if wanted:
            mine = self._remote_v5  # 3.1.1 has neither option: try_private stands for them
            session.subscribe([v5.Subscription(f, q, no_local=mine, retain_as_published=mine) for f, q in wanted])
        if self.spec.notifications:
            if not self.spec.notifications_local_only:
                session.publish(self.state_topic, b"1", 1, retain=True)
            self._notify_local(b"1")
        if self.local.up:
            self._subscribe_locally(0)  # the retained messages again, for the remote

    def _notify_local(self, payload: bytes) -> None:
        if not self.spec.notifications:
            return
        if self._announce is not None:
            self._announce(self.state_topic, payload)
        elif self.local.up:
            self.local.session.publish(self.state_topic, payload, 1, retain=True)

    def _outgoing(self, message: Message) -> None:
        topic = map_outgoing(self.spec.topics, message.topic)
        if topic is None or (not message.qos and not self.remote.up):
            self.local.session.acknowledge(message)
            return
        retain = message.retain and self.spec.bridge_outgoing_retain
        token = self.remote.session.publish(topic, message.payload, message.qos, retain, _forwarded(message))
        self.forwarded_out += 1
        if message.qos:
            self._out[token] = message

    def _incoming(self, message: Message) -> None:
        topic = map_incoming(self.spec.topics, message.topic)
        token = self.local.session.publish(topic, message.payload, message.qos, message.retain, _forwarded(message))
        self.forwarded_in += 1
        if message.qos:
            self._in[token] = message


def _forwarded(message: Message) -> Properties:
    # A message's own properties go on (user properties, expiry, content type); the
    # subscription identifiers were the receiving subscription's, never the sender's.
    props = message.properties
    return props.replace(subscription_identifiers=()) if props.subscription_identifiers else props


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _why(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return str(exc) or type(exc).__name__
