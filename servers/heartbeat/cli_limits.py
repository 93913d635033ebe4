"""The command line's bounds on what one client may make a worker hold: the options,
their defaults, and the configuration fields they fill (see :mod:`.mqtt.policy` and
:mod:`.broker.retained` for why each default is what it is)."""

from __future__ import annotations

import argparse
from typing import Any

from .broker.persistent import DEFAULT_MAX_SESSIONS
from .broker.retained import DEFAULT_MAX_OWNER_BYTES, DEFAULT_MAX_OWNER_COUNT
from .coordination.registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .mqtt.policy import (
    DEFAULT_MAX_CLIENT_ID,
    DEFAULT_MAX_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_MAX_USERNAME,
)
from .security.connect_rate import DEFAULT_CONNECT_RATE

__all__ = ["add_limit_arguments", "limits_from"]

# (option, config field, default, what it bounds and what happens past it)
_LIMITS: tuple[tuple[str, str, int, str], ...] = (
    (
        "--max-client-id",
        "max_client_id",
        DEFAULT_MAX_CLIENT_ID,
        "bytes of UTF-8 in a client id; longer: CONNACK 2",
    ),
    (
        "--max-username",
        "max_username",
        DEFAULT_MAX_USERNAME,
        "bytes of UTF-8 in a username (or a certificate's CN standing for one); longer: CONNACK 4",
    ),
    (
        "--max-subscriptions",
        "max_subscriptions",
        DEFAULT_MAX_SUBSCRIPTIONS,
        "topic filters one client may hold; past it: 0x80 in SUBACK for the filter",
    ),
    (
        "--max-subscription-bytes",
        "max_subscription_bytes",
        DEFAULT_MAX_SUBSCRIPTION_BYTES,
        "bytes of filter text one client may hold; past it: 0x80 in SUBACK",
    ),
    (
        "--max-persistent-sessions",
        "max_persistent_sessions",
        DEFAULT_MAX_SESSIONS,
        "persistent sessions (CleanSession=0) kept at once, on the server or the fleet; past it, a CONNECT "
        "that would start one gets CONNACK 3 (a stored one still resumes)",
    ),
    (
        "--max-device-record-bytes",
        "max_device_record_bytes",
        DEFAULT_RECORD_BYTES,
        "bytes of device records kept for /devices and retained presence (about 384 per record plus its id); "
        "past it, offline records are forgotten, ids seen only once first",
    ),
    (
        "--max-retained-per-client",
        "max_retained_per_client",
        DEFAULT_MAX_OWNER_COUNT,
        "retained messages one client may hold (each counts for the client that set it last); past it, a "
        "new one is refused and the topic keeps its old one",
    ),
    (
        "--max-retained-bytes-per-client",
        "max_retained_bytes_per_client",
        DEFAULT_MAX_OWNER_BYTES,
        "bytes of retained topics and payloads one client may hold; past it, refused likewise",
    ),
)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the per-client bounds to ``parser``, as an argument group of their own."""
    group = parser.add_argument_group("what one client may make the server hold")
    group.add_argument(
        "--max-connect-rate",
        type=_rate,
        default=DEFAULT_CONNECT_RATE,
        help="CONNECTs a second from one source address (an IPv6 one by its /64), after a burst of a "
        "minute's worth; past it, CONNACK 3 before any password check; 0: unbounded "
        f"(default: {DEFAULT_CONNECT_RATE:g})",
    )
    for option, _, default, what in _LIMITS:
        group.add_argument(option, type=_positive, default=default, help=f"{what} (default: {default:,})")


def limits_from(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields the parsed bounds fill (``HeartbeatConfig(**...)``)."""
    fields = {field: getattr(args, field) for _, field, _, _ in _LIMITS}
    fields["max_connect_rate"] = args.max_connect_rate
    return fields


def _rate(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 (unbounded) or more, not {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
