"""One bridge as an operator writes it (:class:`BridgeSpec`): a Mosquitto ``connection``
section's values, checked, with Mosquitto 2.0's defaults, and its command-line form.

The command-line form (the ``--bridge`` option's; :meth:`BridgeSpec.text` writes it,
:func:`parse_bridge` reads it) is a URL::

    mqtt[s]://HOST[:PORT][,HOST[:PORT]...]/NAME?topic=TOPIC[&topic=TOPIC...][&KEY=VALUE...]

    mqtt://broker.example:1883/to-cloud?topic=sensors/#%20out%201%20""%20site-7/
    mqtts://a.example:8883,b.example:8883/to-cloud?topic=cmd/#%20in&bridge_cafile=ca.pem&round_robin=true

The hosts are the ``address`` directive's, tried in turn (an IPv6 address in
brackets; the port 1883 when none is given); ``NAME`` is the connection's name;
``mqtts`` insists on TLS, which is on when ``bridge_cafile`` or ``bridge_capath`` is
given, as in Mosquitto. Each ``topic`` is the directive's value (:mod:`.topics`), its
blanks written ``%20``; a ``#`` may be written as it is (the form has no fragment)
and a ``+`` is a ``+`` (not a blank). The other keys are the connection section's
directives by Mosquitto's names (:data:`BRIDGE_KEYS`), percent-encoded where they
hold ``&``, ``=`` or ``%``, each value checked as the directive's is.

Pure: the files named are checked the way the server's options check theirs (opened
and closed); nothing resolves, connects or reads a clock.
"""

from __future__ import annotations

import difflib
import socket
import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import Any

from ...settings import Choice, Flag, Host, Kind, Number, Path, SettingError, Text
from .topics import BridgeTopic, parse_topic

__all__ = [
    "BRIDGE_KEYS",
    "DEFAULT_PORT",
    "PROTOCOL_VERSIONS",
    "START_TYPES",
    "BridgeAddress",
    "BridgeSpec",
    "RestartTimeout",
    "parse_address",
    "parse_bridge",
    "parse_restart_timeout",
]

DEFAULT_PORT = 1883
PROTOCOL_VERSIONS = ("mqttv311", "mqttv50")
"""The ``bridge_protocol_version`` values the bridge speaks (Mosquitto's names)."""
START_TYPES = ("automatic", "lazy", "once")
TLS_VERSIONS = ("tlsv1.3", "tlsv1.2", "tlsv1.1")
LARGEST_PACKET = 268435460
"""The largest MQTT packet: a 268435455-byte remainder, its header and length."""


@dataclass(frozen=True)
class BridgeAddress:
    """One remote broker to connect to."""

    host: str
    port: int = DEFAULT_PORT

    def text(self) -> str:
        """``HOST:PORT``, an IPv6 address in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> BridgeAddress:
    """``HOST[:PORT]`` as Mosquitto reads it: the port after the *last* colon, so an IPv6
    address needs its port (``2001:db8::1:1883``); ``[2001:db8::1]:1883`` is read too."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise SettingError(f"expected [IPV6]:PORT, not {text!r}")
        port_text = rest[1:] if rest else str(DEFAULT_PORT)
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            host, port_text = text, str(DEFAULT_PORT)
    if not host or any(c.isspace() or c in "/?#@[]," for c in host):
        raise SettingError(f"expected HOST[:PORT], not {text!r}")
    if ":" in host and not _is_ipv6(host):
        raise SettingError(f"an IPv6 address needs its port: ADDRESS:PORT or [ADDRESS]:PORT, not {text!r}")
    try:
        number = int(_PORT.parse(port_text))
    except SettingError as exc:
        raise SettingError(f"the port of {text!r} {exc}") from None
    return BridgeAddress(host, number)


def _is_ipv6(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


_PORT = Number(integer=True, least=1, most=65535, metavar="PORT")


@dataclass(frozen=True)
class RestartTimeout:
    """How long an ``automatic`` bridge waits before connecting again: ``base`` seconds,
    or, with a ``cap``, Mosquitto's "decorrelated jitter" from ``base`` up to ``cap``."""

    base: int = 5
    cap: int | None = 30

    def __post_init__(self) -> None:
        if self.base < 1:
            raise SettingError(f"the restart timeout must be at least 1 second, not {self.base}")
        if self.cap is not None and self.cap < self.base:
            raise SettingError(f"the backoff cap ({self.cap}) is lower than its base ({self.base})")

    def text(self) -> str:
        """The directive's value: ``BASE`` or ``BASE CAP``."""
        return str(self.base) if self.cap is None else f"{self.base} {self.cap}"

    def next_delay(self, previous: float, uniform: Callable[[float, float], float]) -> float:
        """The wait after one that lasted ``previous`` (the base after a connection held):
        a draw of ``uniform(base, 3 * previous)`` held to the cap, or the constant."""
        if self.cap is None:
            return float(self.base)
        return min(float(self.cap), uniform(self.base, max(self.base, 3 * previous)))


def parse_restart_timeout(text: str) -> RestartTimeout:
    """``BASE`` (a constant) or ``BASE CAP`` (jitter), in whole seconds."""
    words = text.split()
    if not 1 <= len(words) <= 2:
        raise SettingError(f"expected SECONDS or BASE CAP, not {text!r}")
    seconds = Number(unit="seconds", integer=True, least=1)
    values = [int(seconds.parse(word)) for word in words]
    return RestartTimeout(values[0], values[1] if len(values) > 1 else None)


def _capath(text: str) -> str:
    import os

    if not os.path.isdir(text):
        raise ValueError(f"{text} is not a directory of CA certificates")
    return text


def _one_line(text: str) -> str:
    if not text or "\n" in text or "\x00" in text:
        raise ValueError("needs a value of one line")
    return text


def _topic_name(text: str) -> str:
    if not text or "+" in text or "#" in text or "\x00" in text:
        raise ValueError(f"must be a topic to publish to (no wildcard), not {text!r}")
    return text


def _protocol_version(text: str) -> str:
    if text == "mqttv31":
        raise ValueError("mqttv31 (MQTT 3.1) is not spoken by the bridge: use mqttv311 (3.1.1, the default) or mqttv50")
    if text not in PROTOCOL_VERSIONS:
        raise ValueError(f"must be mqttv311 or mqttv50, not {text!r}")
    return text


def _start_type(text: str) -> str:
    if text == "manual":
        raise ValueError("manual is not supported (nor by Mosquitto): automatic, lazy or once")
    if text not in START_TYPES:
        raise ValueError(f"must be automatic, lazy or once, not {text!r}")
    return text


def _alpn(text: str) -> str:
    if not 0 < len(text.encode()) <= 255 or any(c.isspace() for c in text):
        raise ValueError(f"must be one ALPN protocol name (1 to 255 bytes, no blank), not {text!r}")
    return text


_STRING = Text(_one_line)
BRIDGE_KEYS: dict[str, Kind] = {
    "round_robin": Flag(),
    "remote_clientid": _STRING,
    "local_clientid": _STRING,
    "remote_username": _STRING,
    "remote_password": _STRING,
    "local_username": _STRING,
    "local_password": _STRING,
    "bridge_protocol_version": Text(_protocol_version),
    "cleansession": Flag(),
    "local_cleansession": Flag(),
    "keepalive_interval": Number(unit="seconds", integer=True, least=5, most=65535),
    "restart_timeout": Text(parse_restart_timeout),
    "start_type": Text(_start_type),
    "idle_timeout": Number(unit="seconds", integer=True, least=1),
    "threshold": Number(unit="messages", integer=True, least=1),
    "notifications": Flag(),
    "notifications_local_only": Flag(),
    "notification_topic": Text(_topic_name),
    "try_private": Flag(),
    "bridge_attempt_unsubscribe": Flag(),
    "bridge_outgoing_retain": Flag(),
    "bridge_max_packet_size": Number(unit="bytes", integer=True, least=0, most=LARGEST_PACKET, zero="no bound"),
    "bridge_bind_address": Host(),
    "bridge_cafile": Path(),
    "bridge_capath": Text(_capath),
    "bridge_certfile": Path(),
    "bridge_keyfile": Path(),
    "bridge_insecure": Flag(),
    "bridge_tls_version": Choice(TLS_VERSIONS),
    "bridge_alpn": Text(_alpn),
}
"""A connection section's directives that are one value of the spec, by Mosquitto's
names (the spec's fields), and the kind that checks it; ``address`` and ``topic``
are read apart."""


@dataclass(frozen=True)
class BridgeSpec:
    """One bridge: Mosquitto's ``connection`` section, its defaults Mosquitto 2.0's.

    The fields are the directives' names. A client id left out (None) is Mosquitto's
    default, made on the machine the bridge runs on: :meth:`remote_id`,
    :meth:`local_id`, and the notification topic :meth:`notification`.
    """

    name: str
    addresses: tuple[BridgeAddress, ...]
    """Tried in turn; the first is the main one unless ``round_robin``."""
    topics: tuple[BridgeTopic, ...]
    round_robin: bool = False
    remote_clientid: str | None = None
    """None: ``HOSTNAME.NAME``."""
    local_clientid: str | None = None
    """None: ``local.`` and the remote client id."""
    remote_username: str | None = None
    remote_password: str | None = None
    local_username: str | None = None
    local_password: str | None = None
    bridge_protocol_version: str = "mqttv311"
    cleansession: bool = False
    local_cleansession: bool | None = None
    """None: as ``cleansession``."""
    keepalive_interval: int = 60
    restart_timeout: RestartTimeout = RestartTimeout()
    start_type: str = "automatic"
    idle_timeout: int = 60
    """Seconds a ``lazy`` bridge stays connected with nothing to send."""
    threshold: int = 10
    """Messages queued for a ``lazy`` bridge that make it connect."""
    notifications: bool = True
    notifications_local_only: bool = False
    notification_topic: str | None = None
    """None: ``$SYS/broker/connection/<remote client id>/state``."""
    try_private: bool = True
    bridge_attempt_unsubscribe: bool = True
    bridge_outgoing_retain: bool = True
    bridge_max_packet_size: int = 0
    """0: no bound of the bridge's own."""
    bridge_bind_address: str | None = None
    bridge_cafile: str | None = None
    bridge_capath: str | None = None
    bridge_certfile: str | None = None
    bridge_keyfile: str | None = None
    bridge_insecure: bool = False
    bridge_tls_version: str | None = None
    bridge_alpn: str | None = None

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise SettingError(f"a bridge's name is one word, not {self.name!r}")
        if not self.addresses:
            raise SettingError(f"bridge {self.name} has no address (address HOST[:PORT] [HOST[:PORT]...])")
        if not self.topics:
            raise SettingError(f"bridge {self.name} has no topic (topic PATTERN [[[out | in | both] QOS] ...])")
        for side in ("remote", "local"):
            if getattr(self, f"{side}_password") is not None and getattr(self, f"{side}_username") is None:
                raise SettingError(f"{side}_password needs {side}_username (MQTT sends no password without a name)")
        if self.bridge_certfile is not None and self.bridge_keyfile is None:
            raise SettingError("bridge_certfile needs bridge_keyfile")
        if self.bridge_keyfile is not None and self.bridge_certfile is None:
            raise SettingError("bridge_keyfile needs bridge_certfile")
        if not self.tls:
            for key in ("bridge_certfile", "bridge_insecure", "bridge_tls_version", "bridge_alpn"):
                if getattr(self, key):
                    # Mosquitto would silently connect in the clear: a certificate written
                    # for a bridge that then goes without TLS is a mistake worth a refusal.
                    raise SettingError(f"{key} needs bridge_cafile or bridge_capath: TLS is on only with one of them")

    @property
    def tls(self) -> bool:
        """Whether the bridge connects over TLS (``bridge_cafile`` or ``bridge_capath``)."""
        return self.bridge_cafile is not None or self.bridge_capath is not None

    def remote_id(self, hostname: str | None = None) -> str:
        """The client id on the remote broker: ``remote_clientid``, or ``HOSTNAME.NAME``."""
        if self.remote_clientid is not None:
            return self.remote_clientid
        return f"{hostname if hostname is not None else socket.gethostname()}.{self.name}"

    def local_id(self, hostname: str | None = None) -> str:
        """The client id on the local broker: ``local_clientid``, or ``local.`` and :meth:`remote_id`."""
        return self.local_clientid if self.local_clientid is not None else f"local.{self.remote_id(hostname)}"

    def notification(self, hostname: str | None = None) -> str:
        """Where the bridge's state (1 connected, 0 not) is published, retained."""
        if self.notification_topic is not None:
            return self.notification_topic
        return f"$SYS/broker/connection/{self.remote_id(hostname)}/state"

    @property
    def local_clean(self) -> bool:
        """Whether the local side's session is clean (``local_cleansession``, else ``cleansession``)."""
        return self.cleansession if self.local_cleansession is None else self.local_cleansession

    def text(self) -> str:
        """The command-line form (:func:`parse_bridge` reads it back to this spec)."""
        query = [("topic", t.text()) for t in self.topics]
        for f in fields(self):
            if f.name in ("name", "addresses", "topics"):
                continue
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                query.append((f.name, "true" if value else "false"))
            elif isinstance(value, RestartTimeout):
                query.append((f.name, value.text()))
            else:
                query.append((f.name, str(value)))
        where = ",".join(a.text() for a in self.addresses)
        scheme = "mqtts" if self.tls else "mqtt"
        encoded = "&".join(f"{key}={_quote(value)}" for key, value in query)
        return f"{scheme}://{where}/{_quote(self.name)}?{encoded}"


def _quote(text: str) -> str:
    # ``#`` and ``+`` stay readable (the form has no fragment, and ``+`` is never a blank
    # here); what would end a key or a value, and blanks, are encoded.
    return urllib.parse.quote(text, safe="/#+$\"'*!:")


def parse_bridge(text: str) -> BridgeSpec:
    """The command-line form as a :class:`BridgeSpec`; :class:`SettingError` saying what
    is wrong (the scheme, an address, a key and the nearest one there is, a value)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("mqtt", "mqtts"):
        raise SettingError(f"expected mqtt://HOST[:PORT][,HOST[:PORT]...]/NAME?topic=..., not {text!r}")
    head, _, query = rest.partition("?")
    where, slash, name = head.partition("/")
    name = urllib.parse.unquote(name)
    if not slash or not name:
        raise SettingError("needs the bridge's name after the hosts: mqtt://HOST[:PORT]/NAME?...")
    values: dict[str, Any] = {}
    topics = []
    for pair in query.split("&") if query else []:
        key, _, value = pair.partition("=")
        key, value = urllib.parse.unquote(key), urllib.parse.unquote(value)
        if key == "topic":
            topics.append(_checked(key, parse_topic, value))
        elif key in BRIDGE_KEYS:
            if key in values:
                raise SettingError(f"{key} is given twice")
            values[key] = _checked(key, BRIDGE_KEYS[key].parse, value)
        else:
            raise SettingError(f"a bridge has no option {key!r}{nearest_key(key)}")
    addresses = tuple(parse_address(part) for part in where.split(",")) if where else ()
    spec = BridgeSpec(name=name, addresses=addresses, topics=tuple(topics), **values)
    if scheme.lower() == "mqtts" and not spec.tls:
        raise SettingError("mqtts:// needs bridge_cafile or bridge_capath (the CAs the remote's certificate chains to)")
    return spec


def _checked(key: str, parse: Callable[[str], Any], value: str) -> Any:
    try:
        return parse(value)
    except SettingError as exc:
        raise SettingError(f"{key}: {exc}") from None


def nearest_key(key: str, names: Collection[str] | None = None) -> str:
    """`` (did you mean NAME?)`` for the name of ``names`` (the URL form's keys by
    default) nearest ``key``, or ""."""
    known = list(names if names is not None else [*BRIDGE_KEYS, "topic"])
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
