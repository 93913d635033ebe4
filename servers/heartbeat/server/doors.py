"""The server's listeners as its connections meet them (a *door*: what a connection came
in through): each one's TLS, session rules, credentials and ACL, and its figures.

A listener of its own password file or ACL (Mosquitto's ``per_listener_settings``)
applies them to its clients; any other applies the server's. Either way a door reads
them when a check runs, so a reload (SIGHUP) applies to every client at once.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import trio

from ..config import HeartbeatConfig
from ..listener import ListenerConfig, ListenerSpec
from ..mqtt.policy import SessionPolicy
from ..security.acl import AclFile
from ..security.passwords import PasswordFile

__all__ = ["Door", "listeners_of"]


class Door:
    """One listener, as the server and its connections see it."""

    __slots__ = ("accepted", "config", "listener", "name", "online", "policy", "port", "refused", "sockets")

    def __init__(self, config: HeartbeatConfig, listener: ListenerConfig, policy: SessionPolicy) -> None:
        self.config = config
        self.listener = listener
        spec = listener.spec
        self.name = sys.intern(spec.name)
        """``mqtts://0.0.0.0:8883``: how presence events, logs and figures name it."""
        if spec.max_qos is not None or spec.max_topic_alias is not None:
            policy = replace(
                policy,
                max_qos=policy.max_qos if spec.max_qos is None else min(spec.max_qos, policy.max_qos),
                topic_alias_maximum=policy.topic_alias_maximum
                if spec.max_topic_alias is None
                else spec.max_topic_alias,
            )
        self.policy = policy
        """The rules its connections' sessions follow."""
        self.sockets: list[trio.SocketListener] = []
        self.port = spec.port
        """The port it listens on (the one given, once a port-0 listener is open)."""
        self.online = 0
        """Sessions held through it now, on this worker."""
        self.accepted = 0
        """Connections it has accepted, on this worker."""
        self.refused = 0
        """CONNECTs through it refused, on this worker."""

    @property
    def spec(self) -> ListenerSpec:
        """The listener as the operator wrote it."""
        return self.listener.spec

    @property
    def websockets(self) -> bool:
        """It speaks MQTT over WebSockets."""
        return self.listener.spec.protocol == "websockets"

    @property
    def auth(self) -> PasswordFile | None:
        """The password file its clients are checked against (its own, or the server's)."""
        own = self.listener.auth
        return own if own is not None else self.config.auth

    @property
    def acl(self) -> AclFile | None:
        """The ACL its clients are held to (its own, or the server's)."""
        own = self.listener.acl
        return own if own is not None else self.config.acl

    @property
    def allow_anonymous(self) -> bool:
        """Whether a client without a username gets in: the listener's rule, the server's,
        or else Mosquitto's (yes without a password file, no with one)."""
        own = self.listener.spec.allow_anonymous
        if own is not None:
            return own
        if self.config.allow_anonymous is not None:
            return self.config.allow_anonymous
        return self.auth is None

    @property
    def allow_zero_length_clientid(self) -> bool:
        """Whether an empty client id is given one, or refused (2, or 0x85 in 5.0)."""
        own = self.listener.spec.allow_zero_length_clientid
        return self.config.allow_zero_length_clientid if own is None else own

    @property
    def identified_by_certificate(self) -> bool:
        """Its clients are named by their TLS certificate's CN (``use_identity_as_username``)."""
        tls = self.listener.tls
        return tls is not None and tls.use_identity_as_username

    def full(self) -> bool:
        """It holds its ``max_connections`` sessions already."""
        cap = self.listener.spec.max_connections
        return 0 <= cap <= self.online


def listeners_of(config: HeartbeatConfig) -> list[ListenerConfig]:
    """The listeners ``config`` serves: its own list, or else one on ``host:port`` (TLS
    with the server's TLS options) and one for WebSockets on ``ws_port`` if set."""
    if config.listeners is not None:
        return config.listeners
    tls = config.tls
    found = [ListenerConfig(ListenerSpec.serving(config.port, config.host, tls), tls)]
    if config.ws_port is not None:
        found.append(ListenerConfig(ListenerSpec.serving(config.ws_port, config.host, tls, "websockets"), tls))
    return found
