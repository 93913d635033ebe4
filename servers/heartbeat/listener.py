"""One listener of the heartbeat server, as an operator writes it: ``--listener`` on the
command line, or a ``listener`` section of a Mosquitto configuration file.

A server may listen on several addresses and ports at once, each speaking MQTT over
TCP or over WebSockets, each with its own TLS, its own limits and (Mosquitto's
``per_listener_settings true``) its own password file and ACL; all of them are one
broker with one presence registry. The command-line form is a URL::

    --listener mqtt://127.0.0.1:1883
    --listener 'mqtt://0.0.0.0:8883?certfile=server.pem&keyfile=server.key&cafile=ca.pem&require_certificate=true'
    --listener ws://:9001
    --listener 'wss://[::1]:9443?certfile=server.pem&keyfile=server.key'

``mqtt`` and ``ws`` say the protocol; TLS is on when a ``certfile`` is given, as in
Mosquitto (``mqtts`` and ``wss`` say the same and insist on one). An empty address
listens on every interface. The query's keys are Mosquitto's own directive names
(:data:`LISTENER_KEYS`), percent-encoded where they hold ``&`` or ``=``; each value is
checked as the directive's would be.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, fields, replace
from typing import Any

import idlekeeper

from ..settings import Choice, Flag, Kind, Number, Path, SettingError, Text, port
from ..tls import TLSOptions
from .security.acl import AclFile, AclFileError
from .security.passwords import AuthFileError, PasswordFile

__all__ = [
    "LISTENER_KEYS",
    "PROTOCOLS",
    "SCHEMES",
    "ListenerConfig",
    "ListenerError",
    "ListenerSpec",
    "parse_listener",
]

PROTOCOLS = ("mqtt", "websockets")
"""Mosquitto's ``protocol`` values."""

SCHEMES = {"mqtt": ("mqtt", False), "mqtts": ("mqtt", True), "ws": ("websockets", False), "wss": ("websockets", True)}
"""A ``--listener`` URL's scheme: the protocol, and whether TLS is insisted on."""

TLS_VERSIONS = ("tlsv1.3", "tlsv1.2", "tlsv1.1")


def _interface(text: str) -> str:
    if not text or len(text.encode()) > 15 or "/" in text or any(c.isspace() for c in text):
        raise ValueError(f"not a network interface name: {text!r}")
    return text


def _ciphers(text: str) -> str:
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).set_ciphers(text)
    except ssl.SSLError:
        raise ValueError(f"OpenSSL knows no cipher in {text!r}") from None
    return text


def _capath(text: str) -> str:
    import os

    if not os.path.isdir(text):
        raise ValueError(f"{text} is not a directory of CA certificates")
    return text


LISTENER_KEYS: dict[str, Kind] = {
    "protocol": Choice(PROTOCOLS),
    "socket_domain": Choice(("ipv4", "ipv6")),
    "bind_interface": Text(_interface, metavar="IFACE"),
    "certfile": Path(),
    "keyfile": Path(),
    "cafile": Path(),
    "capath": Text(_capath, metavar="DIR"),
    "require_certificate": Flag(),
    "use_identity_as_username": Flag(),
    "tls_version": Choice(TLS_VERSIONS),
    "ciphers": Text(_ciphers, metavar="CIPHERS"),
    "max_connections": Number(integer=True, least=-1, metavar="N"),
    "max_qos": Number(integer=True, least=0, most=2, metavar="QOS"),
    "max_topic_alias": Number(integer=True, least=0, most=65535, metavar="N"),
    "password_file": Path(),
    "acl_file": Path(),
    "allow_anonymous": Flag(),
    "allow_zero_length_clientid": Flag(),
}
"""The directives a listener may have of its own, by Mosquitto's names, and the values
each takes. The last four are a listener's own only with ``per_listener_settings true``
(otherwise they are the whole server's)."""

SECURITY_KEYS = ("password_file", "acl_file", "allow_anonymous", "allow_zero_length_clientid")
"""The keys that are a listener's own only under ``per_listener_settings``."""


@dataclass(frozen=True)
class ListenerSpec:
    """One listener, as written (file paths, not their contents: each worker loads them)."""

    port: int
    address: str = ""
    """Where to bind; empty: every interface (IPv4 and IPv6, unless ``socket_domain``)."""
    protocol: str = "mqtt"
    socket_domain: str | None = None
    bind_interface: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    capath: str | None = None
    require_certificate: bool = False
    use_identity_as_username: bool = False
    tls_version: str | None = None
    ciphers: str | None = None
    max_connections: int = -1
    """Connections this listener holds at once (-1: no bound of its own)."""
    max_qos: int | None = None
    """None: the server's ``--max-qos``."""
    max_topic_alias: int | None = None
    """None: the server's ``--max-topic-alias``."""
    password_file: str | None = None
    acl_file: str | None = None
    allow_anonymous: bool | None = None
    """None: the server's rule."""
    allow_zero_length_clientid: bool | None = None
    """None: the server's rule."""

    def __post_init__(self) -> None:
        if self.keyfile is not None and self.certfile is None:
            raise SettingError("keyfile needs certfile (TLS is on when a listener has a certfile)")
        if self.certfile is not None and self.keyfile is None:
            raise SettingError("certfile needs keyfile")
        tls_only = ("cafile", "capath", "require_certificate", "use_identity_as_username", "tls_version", "ciphers")
        if self.certfile is None:
            for name in tls_only:
                if getattr(self, name):
                    raise SettingError(f"{name} needs certfile: this listener has no TLS")
        if self.require_certificate and not (self.cafile or self.capath):
            raise SettingError("require_certificate needs cafile or capath (the CAs client certificates chain to)")
        if self.use_identity_as_username and not self.require_certificate:
            raise SettingError("use_identity_as_username needs require_certificate (no certificate, no identity)")
        family = _family(self.address)
        if family is not None and self.socket_domain is not None and family != self.socket_domain:
            raise SettingError(f"socket_domain {self.socket_domain} does not go with the address {self.address}")

    @property
    def tls(self) -> bool:
        """Whether this listener speaks TLS."""
        return self.certfile is not None

    @property
    def scheme(self) -> str:
        """``mqtt``, ``mqtts``, ``ws`` or ``wss``."""
        base = "mqtt" if self.protocol == "mqtt" else "ws"
        return base + ("s" if self.tls else "")

    @property
    def name(self) -> str:
        """How logs, presence events and figures name it: ``mqtts://0.0.0.0:8883``."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{host}:{self.port}"

    def text(self) -> str:
        """The ``--listener`` form (:func:`parse_listener` reads it back to this)."""
        query = {}
        for f in fields(self):
            if f.name in ("port", "address", "protocol"):
                continue
            value = getattr(self, f.name)
            if value == f.default:
                continue
            query[f.name] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        return self.name + (f"?{encoded}" if encoded else "")

    @classmethod
    def serving(cls, port: int, address: str, tls: TLSOptions | None, protocol: str = "mqtt") -> ListenerSpec:
        """The listener of ``--port`` or ``--ws-port``: TLS with the server's TLS options."""
        if tls is None:
            return cls(port=port, address=address, protocol=protocol)
        return cls(
            port=port,
            address=address,
            protocol=protocol,
            certfile=tls.cert,
            keyfile=tls.key,
            cafile=tls.ca_file,
            require_certificate=tls.require_certificate,
            use_identity_as_username=tls.use_identity_as_username,
        )

    def with_port(self, new_port: int) -> ListenerSpec:
        """The same listener on another port (the one a port-0 listener was given)."""
        return replace(self, port=new_port)


class ListenerError(ValueError):
    """A listener's file does not load; the message names the listener and the file."""


@dataclass
class ListenerConfig:
    """A listener ready to serve: its spec, and its TLS settings, password file and ACL
    loaded (None: the server's own apply). The files are replaced on SIGHUP."""

    spec: ListenerSpec
    tls: TLSOptions | None = None
    auth: PasswordFile | None = None
    acl: AclFile | None = None

    @classmethod
    def load(
        cls, spec: ListenerSpec, handshake_timeout: float = idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT
    ) -> ListenerConfig:
        """Load ``spec``'s files; :class:`ListenerError` naming the listener and the
        file if one does not load."""
        tls = None
        if spec.certfile is not None and spec.keyfile is not None:
            tls = TLSOptions(
                cert=spec.certfile,
                key=spec.keyfile,
                ca_file=spec.cafile,
                capath=spec.capath,
                require_certificate=spec.require_certificate,
                use_identity_as_username=spec.use_identity_as_username,
                tls_version=spec.tls_version,
                ciphers=spec.ciphers,
                handshake_timeout=handshake_timeout,
            )
            _check_context(spec, tls)
        try:
            return cls(
                spec,
                tls,
                PasswordFile.load(spec.password_file) if spec.password_file else None,
                AclFile.load(spec.acl_file) if spec.acl_file else None,
            )
        except (AuthFileError, AclFileError) as exc:
            raise ListenerError(f"listener {spec.name}: {exc}") from None


def _check_context(spec: ListenerSpec, tls: TLSOptions) -> None:
    import ssl

    try:
        tls.context()
    except ssl.SSLError as exc:
        raise ListenerError(
            f"listener {spec.name}: certfile {spec.certfile} and keyfile {spec.keyfile} do not load as a PEM "
            f"certificate and its key, or cafile/capath as CAs ({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise ListenerError(f"listener {spec.name}: the TLS files do not load: {exc.strerror or exc}") from None


def _family(address: str) -> str | None:
    """``ipv4`` or ``ipv6`` for an address written as one (None: a name, or every interface)."""
    import ipaddress

    try:
        return "ipv4" if ipaddress.ip_address(address).version == 4 else "ipv6"
    except ValueError:
        return None


def parse_listener(text: str) -> ListenerSpec:
    """``--listener``'s value as a :class:`ListenerSpec`; :class:`SettingError` saying what
    is wrong (the scheme, the port, a key and the nearest one it knows, a value)."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "mqtt", text
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise SettingError(f"the scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")
    protocol, insists_tls = SCHEMES[scheme]
    where, _, query = rest.partition("?")
    address, port_text = _split_address(where)
    values: dict[str, Any] = {"protocol": protocol}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key not in LISTENER_KEYS:
            raise SettingError(f"a listener has no option {key!r}{_nearest(key)}")
        try:
            values[key] = LISTENER_KEYS[key].parse(value)
        except SettingError as exc:
            raise SettingError(f"{key}: {exc}") from None
    if values["protocol"] != protocol:
        raise SettingError(f"protocol={values['protocol']} contradicts the scheme {scheme}://")
    try:
        listener_port = int(port().parse(port_text))
    except SettingError as exc:
        raise SettingError(f"the port {exc}") from None
    spec = ListenerSpec(port=listener_port, address=address, **values)
    if insists_tls and not spec.tls:
        raise SettingError(f"{scheme}:// needs certfile and keyfile (TLS)")
    return spec


def _split_address(where: str) -> tuple[str, str]:
    if where.startswith("["):
        host, bracket, port_text = where[1:].partition("]")
        if not bracket or not port_text.startswith(":"):
            raise SettingError(f"expected [ADDRESS]:PORT, not {where!r}")
        return host, port_text[1:]
    host, colon, port_text = where.rpartition(":")
    if not colon:
        return "", where  # only a port: every interface
    if ":" in host:
        raise SettingError(f"an IPv6 address goes in brackets: [{host}]:{port_text}")
    return host, port_text


def _nearest(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, LISTENER_KEYS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
