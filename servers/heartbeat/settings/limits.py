"""The per-client bounds of the heartbeat server: what one client may make it hold (see
:mod:`..mqtt.policy` and :mod:`..broker.retained` for why each default is what it is)."""

from __future__ import annotations

import argparse
from typing import Any

from ...settings import Number, Setting, count
from ..broker.persistent import DEFAULT_MAX_SESSIONS
from ..broker.retained import DEFAULT_MAX_OWNER_BYTES, DEFAULT_MAX_OWNER_COUNT
from ..coordination.registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from ..mqtt.policy import (
    DEFAULT_MAX_CLIENT_ID,
    DEFAULT_MAX_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_MAX_USERNAME,
)
from ..security.connect_rate import DEFAULT_CONNECT_RATE

__all__ = ["CONNECT_RATE", "LIMITS", "limits_from"]

_LIMIT = "what one client may make the server hold"

LIMITS: tuple[Setting, ...] = (
    Setting(
        "--max-client-id",
        count("bytes"),
        DEFAULT_MAX_CLIENT_ID,
        f"bytes of UTF-8 in a client id; longer: CONNACK 2 (default: {DEFAULT_MAX_CLIENT_ID:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-username",
        count("bytes"),
        DEFAULT_MAX_USERNAME,
        "bytes of UTF-8 in a username (or a certificate's CN standing for one); longer: CONNACK 4 "
        f"(default: {DEFAULT_MAX_USERNAME:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-subscriptions",
        count("topic filters"),
        DEFAULT_MAX_SUBSCRIPTIONS,
        "topic filters one client may hold; past it: 0x80 in SUBACK for the filter "
        f"(default: {DEFAULT_MAX_SUBSCRIPTIONS:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-subscription-bytes",
        count("bytes"),
        DEFAULT_MAX_SUBSCRIPTION_BYTES,
        "bytes of filter text one client may hold; past it: 0x80 in SUBACK "
        f"(default: {DEFAULT_MAX_SUBSCRIPTION_BYTES:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-persistent-sessions",
        count("sessions"),
        DEFAULT_MAX_SESSIONS,
        "persistent sessions (CleanSession=0) kept at once, on the server or the fleet; past it, a CONNECT "
        f"that would start one gets CONNACK 3 (a stored one still resumes) (default: {DEFAULT_MAX_SESSIONS:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-device-record-bytes",
        count("bytes"),
        DEFAULT_RECORD_BYTES,
        "bytes of device records kept for /devices and retained presence (about 384 per record plus its id); "
        f"past it, offline records are forgotten, ids seen only once first (default: {DEFAULT_RECORD_BYTES:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-retained-per-client",
        count("messages"),
        DEFAULT_MAX_OWNER_COUNT,
        "retained messages one client may hold (each counts for the client that set it last); past it, a "
        f"new one is refused and the topic keeps its old one (default: {DEFAULT_MAX_OWNER_COUNT:,})",
        group=_LIMIT,
    ),
    Setting(
        "--max-retained-bytes-per-client",
        count("bytes"),
        DEFAULT_MAX_OWNER_BYTES,
        "bytes of retained topics and payloads one client may hold; past it, refused likewise "
        f"(default: {DEFAULT_MAX_OWNER_BYTES:,})",
        group=_LIMIT,
    ),
)
"""The per-client bounds, each a field of the configuration named as its option."""

CONNECT_RATE = Setting(
    "--max-connect-rate",
    Number(unit="CONNECTs a second", least=0.0, metavar="RATE", zero="unbounded"),
    DEFAULT_CONNECT_RATE,
    "CONNECTs a second from one source address (an IPv6 one by its /64), after a burst of a "
    "minute's worth; past it, CONNACK 3 before any password check; 0: unbounded "
    f"(default: {DEFAULT_CONNECT_RATE:g})",
    group=_LIMIT,
)
"""``--max-connect-rate``, listed with the bounds."""


def limits_from(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields the parsed bounds fill (``HeartbeatConfig(**...)``)."""
    fields = {setting.dest: getattr(args, setting.dest) for setting in LIMITS}
    fields["max_connect_rate"] = args.max_connect_rate
    return fields
