"""Topic access control read from a Mosquitto ``acl_file``, with Mosquitto 2.0's semantics.

Operators bring their Mosquitto ACL file unchanged::

    # anonymous clients (no username): the lines before the first ``user``
    topic read public/#
    user alice
    topic readwrite alice/#
    topic deny alice/secret
    # every client, anonymous too: %c is the client id, %u the username
    pattern readwrite devices/%c/#

``topic [read|write|readwrite|deny] TOPIC`` grants (readwrite when the access word is
left out) to the current section's user; ``pattern ...`` to every client. A client
gets its own section's rules and, only when none of those decides, the patterns (so
a section's grant beats a pattern's deny); a named user never gets the anonymous
section. Within each of the two, a matching ``deny`` wins over any grant wherever it
stands; a grant lacking the access asked for does not decide.
A pattern naming ``%u`` does not apply to anonymous clients. When the file has
patterns, a client whose username or client id holds ``+`` or ``#`` gets nothing
from them (as Mosquitto 2.0: it could otherwise widen its own rules). Beyond that, a
pattern naming ``%c`` does not apply to a client whose id holds ``/``, U+0000 or a
control character, nor one naming ``%u`` to a client whose username does (as Mosquitto
2.1): such a value would reach into another client's tree (``devices/%c/#`` with the
id ``sensor1/cmd`` is ``devices/sensor1/cmd/#``).

Like Mosquitto 2.0, the file never refuses a subscription: what a client may read is
decided per message, at delivery (:meth:`AclFile.can_read`, retained messages too),
and what it may publish per PUBLISH (:meth:`AclFile.can_publish`).

A file Mosquitto accepts means the same here. This parser is more lenient in one
way: indented lines (and indented ``#`` comments) are accepted, where Mosquitto
refuses to start.

Exact rules sit in dicts, so a check costs one lookup plus a scan of the wildcard
rules, O(rules) at worst. Patterns are expanded once per (username, client id) and
kept in a bounded cache.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ...textfiles import read_utf8
from ..mqtt.filters import topic_matches

__all__ = ["Access", "AclFile", "AclFileError", "Rule"]

# Mosquitto's limits on a subscription filter, which an ACL topic must pass.
_MAX_TOPIC_BYTES = 65535
_MAX_TOPIC_LEVELS = 200
_CACHE_LIMIT = 8192
# What C's isspace() trims; str.strip() would also eat Unicode spaces a topic may hold.
_BLANKS = " \t\n\r\f\v"
_PLACEHOLDER = re.compile(r"(%[cu])")
# Mosquitto lets a (non-bridge) client publish under $SYS only here, before its ACL.
_SYS_WRITABLE = "$SYS/broker/connection/+/state"


class AclFileError(Exception):
    """The ACL file is malformed or unreadable (the message names the file and line)."""


class Access(enum.Flag):
    """What a rule grants; ``DENY`` (no bits) is a ``deny`` rule."""

    DENY = 0
    READ = 1
    WRITE = 2
    READWRITE = READ | WRITE


# The bits as plain ints: the per-message path avoids enum arithmetic.
_READ = Access.READ.value
_WRITE = Access.WRITE.value

_ACCESS_WORDS = {
    "read": Access.READ,
    "write": Access.WRITE,
    "readwrite": Access.READWRITE,
    "deny": Access.DENY,
}


@dataclass(frozen=True)
class Rule:
    """One ``topic`` or ``pattern`` line of the file.

    ``username`` is the section a ``topic`` line is in (``None``: anonymous clients);
    a pattern has none, as it applies to every client.
    """

    pattern: bool
    username: str | None
    access: Access
    topic: str
    line: int


def _valid_filter(topic: str) -> bool:
    levels = topic.split("/")
    if len(levels) - 1 > _MAX_TOPIC_LEVELS or len(topic.encode()) > _MAX_TOPIC_BYTES:
        return False
    for i, level in enumerate(levels):
        if level in ("+", "#"):
            if level == "#" and i != len(levels) - 1:
                return False
        elif "+" in level or "#" in level:
            return False
    return True


def _has_wildcard(topic: str) -> bool:
    return "+" in topic or "#" in topic


# What a %c or %u value must not hold: a level separator would reach beyond the
# client's own level of the pattern; NUL and controls are never a name. (A wildcard
# takes every pattern away: see _has_wildcard's callers.)
_UNSAFE_VALUE = re.compile("[/\x00-\x1f\x7f-\x9f]")


def _unsafe(value: str | None) -> bool:
    return value is not None and _UNSAFE_VALUE.search(value) is not None


class _RuleSet:
    """One client's rules for a single phase (its own section, or the expanded patterns)."""

    __slots__ = ("_deny_exact", "_deny_wild", "_exact", "_wild")

    def __init__(self, entries: Iterable[tuple[str, Access]]) -> None:
        deny_exact: set[str] = set()
        deny_wild: list[str] = []
        exact: dict[str, int] = {}
        # Indexed by the access bit asked for (1: read, 2: write); a grant without that
        # bit cannot decide, so it is not even matched.
        wild: tuple[list[str], list[str], list[str]] = ([], [], [])
        for topic, access in entries:
            bits = access.value
            if not bits:
                if _has_wildcard(topic):
                    deny_wild.append(topic)
                else:
                    deny_exact.add(topic)
            elif _has_wildcard(topic):
                for bit in (_READ, _WRITE):
                    if bits & bit:
                        wild[bit].append(topic)
            else:
                exact[topic] = exact.get(topic, 0) | bits
        self._deny_exact = frozenset(deny_exact)
        self._deny_wild = tuple(deny_wild)
        self._exact = exact
        self._wild = (tuple(wild[0]), tuple(wild[1]), tuple(wild[2]))

    def decide(self, topic: str, bit: int) -> bool | None:
        """False if a deny matches, True if a grant with ``bit`` does, else None (undecided)."""
        if topic in self._deny_exact:
            return False
        for f in self._deny_wild:
            if topic_matches(f, topic):
                return False
        if self._exact.get(topic, 0) & bit:
            return True
        for f in self._wild[bit]:
            if topic_matches(f, topic):
                return True
        return None


def _covers(grant: str, topic_filter: str) -> bool:
    """Whether every topic ``topic_filter`` matches is matched by ``grant`` too."""
    g_levels = grant.split("/")
    f_levels = topic_filter.split("/")
    if topic_filter[:1] in ("+", "#") and grant[:1] not in ("+", "#"):
        return False
    if topic_filter[:1] == "$" and grant[:1] in ("+", "#"):
        return False  # "#" reads no $ topic (MQTT-4.7.2-1): not $SYS/presence/# either
    for i, f in enumerate(f_levels):
        if i >= len(g_levels):
            return False
        g = g_levels[i]
        if g == "#":
            return True
        if f == "#":
            return False  # the filter reaches deeper than a grant without "#" does
        if g != "+" and g != f:
            return False  # a literal grant level covers only that literal ("+" in the filter too)
    # "a/#" also matches "a": the grant must then match "a" as well.
    return len(g_levels) == len(f_levels) or (len(g_levels) == len(f_levels) + 1 and g_levels[-1] == "#")


class _Pattern:
    __slots__ = ("access", "pieces", "uses_client_id", "uses_username")

    def __init__(self, topic: str, access: Access) -> None:
        # Odd pieces are the placeholders, replaced left to right as Mosquitto does
        # ("%%c" is a literal "%" then the client id).
        self.pieces = tuple(_PLACEHOLDER.split(topic))
        self.uses_client_id = "%c" in self.pieces[1::2]
        self.uses_username = "%u" in self.pieces[1::2]
        self.access = access

    def applies(self, username: str | None, client_id: str) -> bool:
        """Whether this pattern is a rule for a client with no wildcard in its id or
        username (see the module docs)."""
        if self.uses_username and (username is None or _unsafe(username)):
            return False
        return not (self.uses_client_id and _unsafe(client_id))

    def expand(self, username: str | None, client_id: str) -> str:
        values = {"%c": client_id, "%u": username or ""}
        return "".join(values[p] if i % 2 else p for i, p in enumerate(self.pieces))


class AclFile:
    """The rules of one ACL file; ask it whether a client may publish or read a topic.

    Immutable once parsed: :meth:`reload` returns a new instance, so a server swaps
    the reference and keeps the old rules when the new file is broken.
    """

    def __init__(self, rules: Iterable[Rule], path: str | None = None) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.path = path
        sections: dict[str | None, list[tuple[str, Access]]] = {}
        for rule in self.rules:
            if not rule.pattern:
                sections.setdefault(rule.username, []).append((rule.topic, rule.access))
        self._sections = {user: _RuleSet(entries) for user, entries in sections.items()}
        self._patterns = tuple(_Pattern(r.topic, r.access) for r in self.rules if r.pattern)
        self._expanded: dict[tuple[str | None, str], _RuleSet | None] = {}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AclFile:
        """Read an ACL file; :class:`AclFileError` if it is unreadable or malformed."""
        name, text = read_utf8(path, AclFileError)
        return cls.parse(text, name, path=name)

    @classmethod
    def parse(cls, text: str, name: str = "<acl>", *, path: str | None = None) -> AclFile:
        """Parse ACL-file text; ``name`` is what error messages call it, ``path`` what :meth:`reload` reads."""
        rules: list[Rule] = []
        user: str | None = None
        # Only "\n" ends a line, as for fgets(); str.splitlines() would also split on
        # characters a topic may contain.
        for number, raw in enumerate(text.split("\n"), 1):
            line = raw.strip(_BLANKS)
            if not line or line.startswith("#"):
                continue
            # Fields are separated by spaces only (a tab belongs to the word), as in Mosquitto.
            keyword, _, rest = line.partition(" ")
            if keyword in ("topic", "pattern"):
                rules.append(_parse_rule(keyword == "pattern", user, rest.lstrip(" "), name, number))
            elif keyword == "user":
                user = rest.strip(_BLANKS)
                if not user:
                    raise AclFileError(f"{name}:{number}: 'user' needs a username")
            else:
                raise AclFileError(f"{name}:{number}: unknown keyword {keyword!r} (expected topic, user or pattern)")
        return cls(rules, path)

    def reload(self) -> AclFile:
        """Read this file's path again: a new :class:`AclFile`, or :class:`AclFileError`.

        ``self`` is left as it was, so on error the caller keeps enforcing the old rules.
        """
        if self.path is None:
            raise ValueError("this AclFile was not loaded from a file")
        return AclFile.load(self.path)

    def can_subscribe(self, username: str | None, client_id: str, topic_filter: str) -> bool:
        """Whether to grant a SUBSCRIBE to ``topic_filter``: always, as in Mosquitto 2.0.

        Mosquitto's ACL file does not judge subscription filters; it filters each
        message at delivery instead (:meth:`can_read`), so a client subscribed to ``#``
        receives exactly the topics it may read.
        """
        return True

    def can_read_filter(self, username: str | None, client_id: str, topic_filter: str) -> bool:
        """Whether some read grant of this client covers every topic ``topic_filter`` can
        match (stricter than Mosquitto, which grants any filter and drops per message).

        The server answers 0x80 in SUBACK for a filter that fails this, and still checks
        each message with :meth:`can_read`, so a deny inside a granted filter holds.
        """
        if not _has_wildcard(topic_filter):
            return self.can_read(username, client_id, topic_filter)
        if topic_filter.startswith("$share"):
            return False
        username = username or None
        grants = [r.topic for r in self.rules if not r.pattern and r.username == username and r.access & Access.READ]
        if self._patterns and not (_has_wildcard(client_id) or (username is not None and _has_wildcard(username))):
            grants += [
                p.expand(username, client_id)
                for p in self._patterns
                if p.access & Access.READ and p.applies(username, client_id)
            ]
        return any(_covers(grant, topic_filter) for grant in grants)

    def can_publish(self, username: str | None, client_id: str, topic: str) -> bool:
        """Whether a PUBLISH (or a will) from this client to ``topic`` is let through."""
        if topic.startswith("$"):
            # Mosquitto's broker-wide rules, checked before the file. These are plain
            # prefix tests, so "$SYSTEM/x" counts as $SYS.
            if topic.startswith("$share"):
                return False
            if topic.startswith("$SYS") and not topic_matches(_SYS_WRITABLE, topic):
                return False
        return self._allowed(username, client_id, topic, _WRITE)

    def can_read(self, username: str | None, client_id: str, topic: str) -> bool:
        """Whether a message on ``topic`` may be delivered to this client (retained ones too)."""
        if topic.startswith("$share"):
            return False
        return self._allowed(username, client_id, topic, _READ)

    def _allowed(self, username: str | None, client_id: str, topic: str, bit: int) -> bool:
        if not topic or _has_wildcard(topic):
            return False
        if not username:
            # Mosquitto reads a zero-length username as none: the client is anonymous.
            username = None
        own = self._sections.get(username)
        if own is not None:
            verdict = own.decide(topic, bit)
            if verdict is not None:
                return verdict
        if not self._patterns:
            return False
        expanded = self._for_client(username, client_id)
        return expanded is not None and expanded.decide(topic, bit) is True

    def _for_client(self, username: str | None, client_id: str) -> _RuleSet | None:
        key = (username, client_id)
        try:
            return self._expanded[key]
        except KeyError:
            pass
        rules: _RuleSet | None = None
        if not (_has_wildcard(client_id) or (username is not None and _has_wildcard(username))):
            rules = _RuleSet(
                (p.expand(username, client_id), p.access) for p in self._patterns if p.applies(username, client_id)
            )
        # Bounded so that a reconnect storm of distinct clients cannot grow it without
        # limit; a miss costs one expansion, O(patterns).
        if len(self._expanded) >= _CACHE_LIMIT:
            self._expanded.clear()
        self._expanded[key] = rules
        return rules


def _parse_rule(pattern: bool, user: str | None, rest: str, name: str, number: int) -> Rule:
    keyword = "pattern" if pattern else "topic"
    if not rest:
        raise AclFileError(f"{name}:{number}: '{keyword}' needs a topic")
    word, space, topic = rest.partition(" ")
    if not space:
        # A single word is the topic, even "read" or "deny": Mosquitto reads
        # "topic read" as readwrite access to the topic named "read".
        access, topic = Access.READWRITE, word
    else:
        topic = topic.strip(_BLANKS)
        if word not in _ACCESS_WORDS:
            raise AclFileError(
                f"{name}:{number}: bad access {word!r} (expected read, write, readwrite or deny; "
                "a topic with spaces needs an access word before it)"
            )
        access = _ACCESS_WORDS[word]
    if not _valid_filter(topic):
        raise AclFileError(f"{name}:{number}: invalid topic {topic!r}")
    return Rule(pattern, None if pattern else user, access, topic, number)
