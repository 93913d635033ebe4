"""The directives of a Mosquitto configuration file, as the heartbeat server takes
them: which option each stands for (:data:`DIRECTIVES`, by Mosquitto's name where it
has one, :data:`MOSQUITTO_NAMES`), which are refused and why (:data:`REFUSED`), which
are ignored with a warning (:data:`IGNORED`), and the tables the translation
(:mod:`.translation`) reads."""

from __future__ import annotations

import difflib

from ...settings import Setting
from ..bridge import SECTION_DIRECTIVES
from ..listener import LISTENER_KEYS
from ..settings import SETTINGS

__all__ = ["DIRECTIVES", "IGNORED", "MOSQUITTO_NAMES", "PERSISTENCE_FILE", "REFUSED", "SPECIAL", "nearest"]

MOSQUITTO_NAMES: dict[str, str] = {
    "--host": "bind_address",
    "--port": "port",
    "--auth-file": "password_file",
    "--acl-file": "acl_file",
    "--allow-anonymous": "allow_anonymous",
    "--allow-zero-length-clientid": "allow_zero_length_clientid",
    "--max-inflight": "max_inflight_messages",
    "--max-queued": "max_queued_messages",
    "--max-queued-bytes": "max_queued_bytes",
    "--session-expiry": "persistent_client_expiration",
    "--persistence": "persistence",
    "--log-level": "log_type",
    "--log-file": "log_dest",
    "--tls-cert": "certfile",
    "--tls-key": "keyfile",
    "--tls-ca-file": "cafile",
    "--tls-require-certificate": "require_certificate",
    "--use-identity-as-username": "use_identity_as_username",
    "--max-qos": "max_qos",
    "--max-topic-alias": "max_topic_alias",
    "--max-connections": "max_connections",
    "--listener": "listener",
}
"""The options Mosquitto has a directive for, and its name (the others' are made from
the option's)."""

PERSISTENCE_FILE = "idlekeeper.db"
"""The store's name in ``persistence_location`` when no ``persistence_file`` is given:
not Mosquitto's ``mosquitto.db``, which may be there, in Mosquitto's own format."""

MOSQUITTO_DB_MAGIC = b"\x00\xb5\x00mosquitto db"
"""How Mosquitto's database file begins."""


def directive_name(setting: Setting) -> str:
    """The directive that stands for ``setting``: Mosquitto's name, or the option's own."""
    return MOSQUITTO_NAMES.get(setting.option, setting.option.lstrip("-").replace("-", "_"))


DIRECTIVES: dict[str, Setting] = {
    directive_name(s): s for s in SETTINGS if not s.hidden and s.option not in ("--config", "--listener", "--bridge")
}
"""Each directive that stands for one option, by name (``listener`` is a section)."""

PLUGINS = "plugins are not supported: the password file (password_file) and the ACL (acl_file) are"
_ENGINES = "OpenSSL engines (keys held in hardware) are not supported: give keyfile a PEM key"
_PSK = "TLS-PSK is not supported (Python's ssl module serves certificates): use certfile and keyfile"

REFUSED: dict[str, str] = {
    "auth_plugin": PLUGINS,
    "plugin": PLUGINS,
    "auth_plugin_deny_special_chars": PLUGINS,
    "psk_hint": _PSK,
    "psk_file": _PSK,
    "mount_point": "mount points are not supported: every listener sees one topic tree",
    "http_dir": "the server serves no files over HTTP (its status page is --status-port)",
    "use_username_as_clientid": "not supported: a client's id is the one it sends",
    "use_subject_as_username": "not supported: use_identity_as_username (the certificate's CN) is",
    "crlfile": "certificate revocation lists are not supported",
    "dhparamfile": "not used: the server's TLS key exchange is ECDHE, which needs no DH parameters",
    "ciphers_tls1.3": "TLS 1.3's cipher suites are OpenSSL's defaults here; remove it",
    "tls_engine": _ENGINES,
    "tls_keyform": _ENGINES,
    "tls_engine_kpass_sha1": _ENGINES,
    "queue_qos0_messages": "not supported: QoS 0 messages are never queued for an absent client",
    "upgrade_outgoing_qos": "not supported: a message goes at the lesser of its QoS and the subscription's",
    "websockets_log_level": "libwebsockets' log level: the server's WebSockets are its own, logged with log_type",
    "memory_limit": "not supported: memory is bounded per client and per server by the max_* directives "
    "(max_queued_bytes, max_retained_bytes, ...)",
    "clientid_prefixes": "not supported: any client id is let in (restrict topics with acl_file)",
    "auto_id_prefix": "not supported: a client without an id gets one of the server's own form",
    "autosave_on_changes": "not supported: autosave_interval counts seconds, never changes",
}
"""Mosquitto directives the server does not honour, and why (a value that changes
nothing, ``0`` for the limits whose 0 means none, is let through: see
:data:`DEFAULT_VALUES`)."""

DEFAULT_VALUES = {
    "memory_limit": "0",
}
"""Refused directives written with Mosquitto's default value: what the server does already."""

BRIDGE_DIRECTIVES = tuple(name for name in SECTION_DIRECTIVES if name != "connection")
"""A bridge's directives (:mod:`..bridge`): read in a ``connection`` section (:mod:`.bridges`)."""
for _name in BRIDGE_DIRECTIVES:
    REFUSED[_name] = (
        "a bridge's directive, of a connection section: here no connection NAME is above it in this file"
    )

IGNORED: dict[str, str] = {
    "user": "this server does not drop privileges: run it as the user it should run as (systemd's User=)",
    "log_timestamp": "every log line starts with its time",
    "log_timestamp_format": "every log line starts with its time, in one format",
    "log_facility": "the server does not write to syslog (log to stderr and let the journal keep it)",
    "websockets_headers_size": "the WebSocket handshake's size is bounded by the server itself",
    "check_retain_source": "a retained message is checked against the ACL when it is published",
    "allow_duplicate_messages": "deprecated in Mosquitto 2.0, whose behaviour (true) is the server's",
    "retry_interval": "no longer available in Mosquitto 2.0: MQTT resends only on reconnection",
    "set_tcp_nodelay": "the server always sets TCP_NODELAY",
}
"""Mosquitto directives that are read, warned of and ignored: they change nothing here."""

UNBOUNDED_AT_ZERO = ("max_packet_size", "max_inflight_messages", "max_queued_messages", "max_queued_bytes")
"""Directives whose 0 means "no bound" in Mosquitto: the server keeps its own bound."""

DEFAULT_LISTENER = {
    "certfile": "--tls-cert",
    "keyfile": "--tls-key",
    "cafile": "--tls-ca-file",
    "require_certificate": "--tls-require-certificate",
    "use_identity_as_username": "--use-identity-as-username",
    "max_qos": "--max-qos",
    "max_topic_alias": "--max-topic-alias",
    "max_connections": "--max-connections",
}
"""A listener's directives written outside any listener section (Mosquitto's default
listener, the one of ``port`` and ``bind_address``) that have a server-wide option."""

SECURITY_OPTIONS = {
    "password_file": "--auth-file",
    "acl_file": "--acl-file",
    "allow_anonymous": "--allow-anonymous",
    "allow_zero_length_clientid": "--allow-zero-length-clientid",
}

LOG_LEVELS = {
    "none": "CRITICAL",
    "error": "ERROR",
    "warning": "WARNING",
    "notice": "INFO",
    "information": "INFO",
    "subscribe": "INFO",
    "unsubscribe": "INFO",
    "websockets": "INFO",
    "debug": "DEBUG",
    "internal": "DEBUG",
    "all": "DEBUG",
}
"""Mosquitto's ``log_type`` values and the ``--log-level`` that shows them."""

VERBOSITY = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")

EXPIRY_UNITS = {"h": 3600, "d": 86400, "w": 7 * 86400, "m": 30 * 86400, "y": 365 * 86400}
"""``persistent_client_expiration``'s units, as Mosquitto counts them (a month is 30 days)."""


SPECIAL = (
    "listener",
    "connection",
    "per_listener_settings",
    "persistent_client_expiration",
    "persistence",
    "persistence_location",
    "persistence_file",
    "log_type",
    "log_dest",
)
"""Directives that are not one option's value (:mod:`.translation` has a step for each)."""


def known() -> list[str]:
    """Every directive name this server knows, honoured or not."""
    names = set(DIRECTIVES) | set(REFUSED) | set(IGNORED) | set(LISTENER_KEYS) | set(SPECIAL)
    names.add("include_dir")
    return sorted(names)


def nearest(name: str) -> str:
    """A hint for an unknown directive: the option's Mosquitto name, or the nearest known name."""
    for setting in SETTINGS:
        if setting.option.lstrip("-").replace("-", "_") == name and setting.option in MOSQUITTO_NAMES:
            return f" (--{setting.option.lstrip('-')} is written {MOSQUITTO_NAMES[setting.option]})"
    close = difflib.get_close_matches(name, known(), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
