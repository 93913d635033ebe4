"""Topic filters as MQTT defines them, sans-IO: which topics a filter matches (4.7),
what makes one valid, a shared subscription's ``$share/<group>/<filter>`` form (MQTT 5
§4.8.2) and the options an MQTT 5 subscription carries (§3.8.3.1). Both versions'
sessions, the broker, the ACL and the stores read filters through these."""

from __future__ import annotations

from .packets import ProtocolError

__all__ = [
    "NO_LOCAL",
    "RETAIN_AS_PUBLISHED",
    "SHARE_PREFIX",
    "check_filter",
    "is_wildcard",
    "pack_options",
    "shared_filter",
    "topic_matches",
]

NO_LOCAL = 1
"""An MQTT 5 subscription option: not sent what its own client publishes."""
RETAIN_AS_PUBLISHED = 2
"""An MQTT 5 subscription option: the retain flag as the publisher set it."""

def pack_options(no_local: bool = False, retain_as_published: bool = False, identifier: int = 0) -> int:
    """A subscription's MQTT 5 options as one int: two flags and its Subscription Identifier."""
    return (NO_LOCAL if no_local else 0) | (RETAIN_AS_PUBLISHED if retain_as_published else 0) | (identifier << 2)


def is_wildcard(topic_filter: str) -> bool:
    """Whether ``topic_filter`` holds a wildcard character (else it matches one topic, itself)."""
    return "+" in topic_filter or "#" in topic_filter


SHARE_PREFIX = "$share/"
"""How an MQTT 5 shared subscription's filter begins: ``$share/<group>/<filter>``."""


def shared_filter(topic_filter: str) -> tuple[str, str] | None:
    """``(group, filter)`` of a shared subscription (``$share/<group>/<filter>``, MQTT 5
    §4.8.2), or None for any other filter, or one with no group or no filter."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    group, sep, inner = topic_filter[len(SHARE_PREFIX) :].partition("/")
    if not sep or not group or not inner:
        return None
    return group, inner


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter``.

    ``+`` matches exactly one level, ``#`` its own level and every level below, so
    ``a/#`` matches ``a`` too. Topics starting with ``$`` are not matched by a filter
    starting with a wildcard (MQTT-4.7.2-1), so ``#`` does not see ``$SYS/...``.
    """
    if topic_filter == topic:
        return True
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    levels = topic.split("/")
    parts = topic_filter.split("/")
    count = len(levels)
    for i, part in enumerate(parts):
        if part == "#":
            return True
        if i >= count or (part != "+" and part != levels[i]):
            return False
    return len(parts) == count


def check_filter(topic_filter: str) -> None:
    """Raise :class:`ProtocolError` unless ``topic_filter`` is a valid filter (4.7.1)."""
    if not topic_filter:
        raise ProtocolError("bad-topic-filter", detail="empty filter")
    if "+" not in topic_filter and "#" not in topic_filter:
        return
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level == "+" or (level == "#" and i == last):
            continue
        if "+" in level or "#" in level:
            raise ProtocolError("bad-topic-filter", detail=repr(topic_filter[:64]))
