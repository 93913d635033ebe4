"""A Mosquitto ``connection`` section as a :class:`~.spec.BridgeSpec`
(:func:`bridge_from_directives`), with Mosquitto 2.0.11's reading of each line.

Every directive Mosquitto 2.0.11 takes in a connection section is in one table:
:data:`~.spec.BRIDGE_KEYS` (one value of the spec), :data:`SPECIAL` (``address``,
``topic`` and the like, read by a step of their own), :data:`ALIASES` (the old names
Mosquitto still reads), or :data:`REFUSED` (with the reason; :data:`DEFAULT_ONLY`
lets through the value that changes nothing). :data:`SECTION_DIRECTIVES` is them all.

Mosquitto's reading, kept: a string's value is the rest of the line, blanks and all
(a ``#`` there is part of it), and given twice it is an error; a flag or a number
given twice, the last one counts; ``address`` is one line of one or more hosts,
given once. What Mosquitto quietly raises to its floor is raised here too
(``keepalive_interval`` under 5 is 5, ``idle_timeout``, ``threshold`` and
``restart_timeout`` under 1 are 1, ``bridge_max_packet_size`` under 0 is 0), so a
file Mosquitto runs reads the same; everything else is checked as the spec checks it
and refused at its line.

One departure: Mosquitto 2.0.11 read a single ``restart_timeout`` number as the start
of its jittered backoff, still capped at 30 seconds, where mosquitto.conf(5) says a
constant (fixed in 2.0.15); here it is the constant the manual promises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...conffile import Directive
from ...settings import SettingError
from .spec import BRIDGE_KEYS, BridgeSpec, nearest_key, parse_address
from .topics import parse_topic

__all__ = ["ALIASES", "DEFAULT_ONLY", "REFUSED", "SECTION_DIRECTIVES", "SPECIAL", "bridge_from_directives"]

SPECIAL = ("connection", "address", "addresses", "topic")
"""Directives read by a step of their own: the section's name, its hosts, its topics."""

ALIASES = {"clientid": "remote_clientid", "username": "remote_username", "password": "remote_password"}
"""Mosquitto's old names, still read (mosquitto.conf(5): "remains valid for the time being")."""

_PSK = "TLS-PSK is not supported (Python's ssl module connects with certificates): use bridge_cafile"
REFUSED = {
    "bridge_identity": _PSK,
    "bridge_psk": _PSK,
    "bridge_require_ocsp": "OCSP is not checked (Python's ssl module does not ask for it): remove it, or set false",
}
"""A connection section's directives the bridge will not honour, and why."""

DEFAULT_ONLY = {"bridge_require_ocsp": "false"}
"""Refused directives let through with the value that changes nothing."""

SECTION_DIRECTIVES = tuple(sorted({*SPECIAL, *BRIDGE_KEYS, *ALIASES, *REFUSED}))
"""Every directive Mosquitto 2.0.11 reads in a connection section."""

_STRINGS = {
    "remote_clientid",
    "local_clientid",
    "remote_username",
    "remote_password",
    "local_username",
    "local_password",
    "notification_topic",
    "bridge_bind_address",
    "bridge_cafile",
    "bridge_capath",
    "bridge_certfile",
    "bridge_keyfile",
    "bridge_tls_version",
    "bridge_alpn",
}
"""The directives Mosquitto reads as a string: the rest of the line, once only."""

_FLOORS = {
    "keepalive_interval": 5,
    "idle_timeout": 1,
    "threshold": 1,
    "restart_timeout": 1,
    "bridge_max_packet_size": 0,
}
"""What Mosquitto raises a lower number to (with a notice), rather than refuse it."""


def bridge_from_directives(directives: Sequence[Directive]) -> BridgeSpec:
    """The bridge of one connection section: its ``connection NAME`` line first, then the
    section's own directives. Raises :class:`~servers.conffile.ConfigError` naming the
    line and why (the section as a whole: at its ``connection`` line)."""
    if not directives or directives[0].name != "connection":
        raise ValueError("a connection section begins with its connection directive")
    header, *lines = directives
    words = _words(header)
    if len(words) != 1:
        raise header.error("expected one NAME (connection NAME)" if words else "needs a NAME (connection NAME)")
    values: dict[str, Any] = {}
    seen: dict[str, Directive] = {}
    addresses: list[Any] = []
    topics = []
    for d in lines:
        name = ALIASES.get(d.name, d.name)
        if name in ("address", "addresses"):
            if addresses:
                raise d.error(f"the hosts are given once, on one line (the first: {seen['address'].where})")
            seen["address"] = d
            addresses = [_parse(d, parse_address, word) for word in _words(d)]
            if not addresses:
                raise d.error("needs HOST[:PORT] [HOST[:PORT]...]")
        elif name == "topic":
            topics.append(_parse(d, parse_topic, d.value))
        elif name in REFUSED:
            if _words(d)[:1] != [DEFAULT_ONLY.get(name)]:
                raise d.error(REFUSED[name])
        elif name in BRIDGE_KEYS:
            values[name] = _value(d, name, seen)
        else:
            raise d.error(f"not a bridge's directive{nearest_key(d.name, SECTION_DIRECTIVES)}")
        seen.setdefault(name, d)
    try:
        return BridgeSpec(name=words[0], addresses=tuple(addresses), topics=tuple(topics), **values)
    except SettingError as exc:
        # A rule between two directives: said at the later one when it is there.
        culprit = _named(str(exc), seen) or header
        raise culprit.error(str(exc)) from None


def _value(d: Directive, name: str, seen: dict[str, Directive]) -> Any:
    if name in _STRINGS:
        if name in seen:
            raise d.error(f"given twice (the first: {seen[name].where}); Mosquitto refuses it too")
        text = d.value
    else:
        words = _words(d)
        if name != "restart_timeout" and len(words) > 1:
            raise d.error(f"takes one value, not {d.value!r}")
        if name == "restart_timeout" and len(words) > 2:
            raise d.error(f"expected SECONDS or BASE CAP, not {d.value!r}")
        text = " ".join(words)
        if name in _FLOORS and words:
            text = _floored(d, name, words)
    if not text:
        raise d.error("needs a value")
    return _parse(d, BRIDGE_KEYS[name].parse, text)


def _floored(d: Directive, name: str, words: list[str]) -> str:
    try:
        first = int(words[0], 10)
    except ValueError:
        return " ".join(words)  # not a number: the kind says so
    words = [str(max(first, _FLOORS[name])), *words[1:]]
    return " ".join(words)


def _words(d: Directive) -> list[str]:
    """The value's words up to a comment (a word starting with ``#``)."""
    out = []
    for word in d.words:
        if word.startswith("#"):
            break
        out.append(word)
    return out


def _parse(d: Directive, parse: Any, text: str) -> Any:
    try:
        return parse(text)
    except SettingError as exc:
        raise d.error(str(exc)) from None


def _named(reason: str, seen: dict[str, Directive]) -> Directive | None:
    """The directive a reason begins with (``bridge_certfile needs ...``), if it is in the section."""
    first = reason.split(" ", 1)[0]
    return seen.get(first)
