"""A bridge's topics: Mosquitto's ``topic`` directive as a value (:class:`BridgeTopic`),
and the mapping a Mosquitto 2.0 bridge makes with them, to the letter.

The directive (mosquitto.conf(5))::

    topic PATTERN [[[out | in | both] QOS] LOCAL-PREFIX REMOTE-PREFIX]

``PATTERN`` is a topic filter (wildcards allowed); the direction defaults to ``out``,
the QoS to 0; ``""`` stands for an empty prefix, and for an empty pattern, which is
allowed only when both prefixes are given (the entry then maps the single topic
LOCAL-PREFIX to the single topic REMOTE-PREFIX). A prefix is glued to the pattern as
written (``local/`` + ``#`` is ``local/#``), so it usually ends in ``/``; it may hold
no wildcard, and prefix and pattern together must make a valid filter.

What the bridge does with them (Mosquitto's ``bridge_topic.c``, ``bridge.c`` and
``send_publish.c``):

- it subscribes on the local broker to :attr:`BridgeTopic.local_filter` (the local
  prefix and the pattern) for each ``out`` and ``both`` entry
  (:func:`local_subscriptions`), and on the remote broker to
  :attr:`BridgeTopic.remote_filter` for each ``in`` and ``both`` entry
  (:func:`remote_subscriptions`); an ``out`` entry's remote filter is unsubscribed,
  unless ``bridge_attempt_unsubscribe false`` (:func:`remote_unsubscriptions`);
- a local message goes out when an ``out``/``both`` entry's local filter matches its
  topic; its remote topic is made by the *first* ``out``/``both`` entry that has a
  prefix and whose local filter matches: the local prefix taken off (when the topic
  starts with it), the remote prefix put on; no such entry: the topic as it is
  (:func:`map_outgoing`);
- a remote message comes in on the first ``in``/``both`` entry with a prefix whose
  remote filter matches: the remote prefix taken off, the local prefix put on; no
  such entry: the topic as it is, whatever it is (a remote session kept from an older
  configuration may still send it; mosquitto.conf(5) warns of it) (:func:`map_incoming`).

Pure functions over values: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...settings import SettingError
from ..mqtt.filters import topic_matches

__all__ = [
    "DIRECTIONS",
    "EMPTY",
    "BridgeTopic",
    "local_subscriptions",
    "map_incoming",
    "map_outgoing",
    "parse_topic",
    "remote_subscriptions",
    "remote_unsubscriptions",
]

DIRECTIONS = ("out", "in", "both")
"""A topic's direction: ``out`` local to remote, ``in`` remote to local, ``both``."""
EMPTY = '""'
"""How the directive writes an empty pattern or prefix."""
MOST_LEVELS = 200
"""Mosquitto's bound on the ``/`` in a filter or a prefix (its TOPIC_HIERARCHY_LIMIT)."""
LONGEST = 65535
"""MQTT's bound on a topic's length."""


@dataclass(frozen=True)
class BridgeTopic:
    """One ``topic`` directive of a bridge ("" for an empty pattern or prefix)."""

    pattern: str
    direction: str = "out"
    qos: int = 0
    local_prefix: str = ""
    remote_prefix: str = ""

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise SettingError(f"the direction must be out, in or both, not {self.direction!r}")
        if self.qos not in (0, 1, 2):
            raise SettingError(f"the QoS must be 0, 1 or 2, not {self.qos!r}")
        for side, prefix in (("local", self.local_prefix), ("remote", self.remote_prefix)):
            problem = _topic_problem(prefix)
            if prefix and problem:
                raise SettingError(f"the {side} prefix {prefix!r} {problem}")
        if not self.pattern and not (self.local_prefix and self.remote_prefix):
            # Mosquitto: "Invalid bridge remapping"; an empty pattern names one topic on each side.
            raise SettingError(
                'an empty pattern ("") needs both prefixes: it maps the one topic LOCAL-PREFIX to REMOTE-PREFIX'
            )
        for side, whole in (("local", self.local_filter), ("remote", self.remote_filter)):
            problem = _filter_problem(whole)
            if problem:
                named = "the pattern" if whole == self.pattern else f"the {side} prefix and the pattern, {whole!r},"
                raise SettingError(f"{named} {problem}")

    @property
    def remapped(self) -> bool:
        """Whether the entry has a prefix (only such entries change a topic)."""
        return bool(self.local_prefix or self.remote_prefix)

    @property
    def local_filter(self) -> str:
        """What the bridge subscribes to on the local broker (``out``, ``both``)."""
        return self.local_prefix + self.pattern

    @property
    def remote_filter(self) -> str:
        """What the bridge subscribes to on the remote broker (``in``, ``both``)."""
        return self.remote_prefix + self.pattern

    @property
    def outgoing(self) -> bool:
        """Whether local messages go out on it."""
        return self.direction in ("out", "both")

    @property
    def incoming(self) -> bool:
        """Whether remote messages come in on it."""
        return self.direction in ("in", "both")

    def text(self) -> str:
        """The directive's value (:func:`parse_topic` reads it back to this entry): the
        shortest form that says it all."""
        words = [self.pattern or EMPTY]
        if self.remapped:
            words += [self.direction, str(self.qos), self.local_prefix or EMPTY, self.remote_prefix or EMPTY]
        elif self.qos:
            words += [self.direction, str(self.qos)]
        elif self.direction != "out":
            words.append(self.direction)
        return " ".join(words)


def parse_topic(text: str) -> BridgeTopic:
    """A ``topic`` directive's value as a :class:`BridgeTopic`; :class:`SettingError`
    saying what is wrong.

    Words are split at blanks, as Mosquitto does; from the QoS on, a word starting
    with ``#`` begins a comment (no prefix can start with one). More words than the
    five are refused where Mosquitto drops them unseen.
    """
    words = text.split()
    for i, word in enumerate(words):
        if i >= 2 and word.startswith("#"):
            words = words[:i]
            break
    if not words:
        raise SettingError("needs a pattern: topic PATTERN [[[out | in | both] QOS] LOCAL-PREFIX REMOTE-PREFIX]")
    if len(words) > 5:
        raise SettingError(f"takes at most 5 words (PATTERN DIRECTION QOS LOCAL-PREFIX REMOTE-PREFIX), not {text!r}")
    pattern = _word(words[0])
    direction = "out"
    if len(words) > 1:
        direction = words[1].lower()  # Mosquitto reads the direction in any case
        if direction not in DIRECTIONS:
            raise SettingError(f"the direction must be out, in or both, not {words[1]!r}")
    qos = 0
    if len(words) > 2:
        if words[2] not in ("0", "1", "2"):
            raise SettingError(f"the QoS must be 0, 1 or 2, not {words[2]!r}")
        qos = int(words[2])
    local_prefix = _word(words[3]) if len(words) > 3 else ""
    remote_prefix = _word(words[4]) if len(words) > 4 else ""
    return BridgeTopic(pattern, direction, qos, local_prefix, remote_prefix)


def local_subscriptions(topics: Iterable[BridgeTopic]) -> list[tuple[str, int]]:
    """The local filters (and QoS) the bridge subscribes to: its ``out`` and ``both`` entries', in order."""
    return [(t.local_filter, t.qos) for t in topics if t.outgoing]


def remote_subscriptions(topics: Iterable[BridgeTopic]) -> list[tuple[str, int]]:
    """The remote filters (and QoS) the bridge subscribes to: its ``in`` and ``both`` entries', in order."""
    return [(t.remote_filter, t.qos) for t in topics if t.incoming]


def remote_unsubscriptions(topics: Iterable[BridgeTopic]) -> list[str]:
    """The remote filters of its ``out``-only entries, which the bridge unsubscribes on
    connecting (``bridge_attempt_unsubscribe``): a remote session may hold them from a
    time the entry was ``in``."""
    return [t.remote_filter for t in topics if not t.incoming]


def map_outgoing(topics: Sequence[BridgeTopic], topic: str) -> str | None:
    """The remote topic a local message on ``topic`` is published to, or None when no
    ``out``/``both`` entry's local filter matches it (the bridge does not see it)."""
    if not any(t.outgoing and topic_matches(t.local_filter, topic) for t in topics):
        return None
    for t in topics:
        if t.outgoing and t.remapped and topic_matches(t.local_filter, topic):
            return t.remote_prefix + _strip(topic, t.local_prefix)
    return topic


def map_incoming(topics: Sequence[BridgeTopic], topic: str) -> str:
    """The local topic a message the remote broker sends on ``topic`` is published to."""
    for t in topics:
        if t.incoming and t.remapped and topic_matches(t.remote_filter, topic):
            return t.local_prefix + _strip(topic, t.remote_prefix)
    return topic


def _strip(topic: str, prefix: str) -> str:
    # Only when it is there: a filter ``p/#`` also matches ``p`` itself, which does not
    # start with ``p/``, and Mosquitto then leaves the topic whole (and still adds the
    # other side's prefix): ``p`` goes out as ``r/p``.
    return topic[len(prefix) :] if topic.startswith(prefix) else topic


def _word(word: str) -> str:
    return "" if word == EMPTY else word


def _topic_problem(text: str) -> str | None:
    """Why ``text`` cannot be a topic (a prefix is one), or None."""
    if "+" in text or "#" in text:
        return "holds a wildcard (+ or #): a prefix is put before the pattern, which has them"
    return _size_problem(text)


def _filter_problem(text: str) -> str | None:
    """Why ``text`` is not a valid filter (MQTT 4.7.1, as Mosquitto checks it), or None."""
    levels = text.split("/")
    for i, level in enumerate(levels):
        if level in ("+", "#") and (level == "+" or i == len(levels) - 1):
            continue
        if "+" in level or "#" in level:
            return "is not a valid filter: + must be a whole level, # the whole last level"
    return _size_problem(text)


def _size_problem(text: str) -> str | None:
    if len(text.encode()) > LONGEST:
        return f"is longer than {LONGEST} bytes"
    if text.count("/") > MOST_LEVELS:
        return f"has more than {MOST_LEVELS} levels (Mosquitto's bound)"
    if "\x00" in text:
        return "holds a NUL character"
    return None
