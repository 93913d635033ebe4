"""The frames between a heartbeat worker and its supervisor's authority.

One JSON object per line, typed: each frame is a dataclass, tagged on the wire by
its class name, and :func:`decode` refuses a line that is not a known frame with
the right fields. Presence events travel as their ``to_dict`` form; message bodies
as base64.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass

from ..broker.reports import Acked, AckedTogether, Attach, Detach, Discard, Inbound, Push, Report, Subscribed
from ..mqtt.effects import Will
from ..mqtt.publication import Publication
from ..presence.event import PresenceEvent
from .durable.wills import HeldWill
from .retention import RetainedMessage

__all__ = [
    "Ack",
    "BoxFigures",
    "Kept",
    "OpenSession",
    "Overview",
    "OverviewFound",
    "Reported",
    "RetainedPage",
    "RetainedQuery",
    "WillDone",
    "WillHeld",
    "WillsFound",
    "WillsQuery",
    "SessionOpened",
    "Transmit",
    "Claimed",
    "CloseSubscribers",
    "Deliver",
    "Drained",
    "Ended",
    "Evict",
    "Filters",
    "FiltersChanged",
    "Found",
    "Frame",
    "FrameError",
    "Hello",
    "Lookup",
    "Noted",
    "Numbered",
    "RemoteFilters",
    "RemoteFiltersChanged",
    "Probe",
    "Probed",
    "Resync",
    "Routed",
    "Settle",
    "Settled",
    "decode",
    "encode",
]


class FrameError(ValueError):
    """A line that is not a well-formed frame."""


@dataclass(frozen=True, slots=True)
class Frame:
    """Base of every frame."""


# -- worker to authority -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Frame):
    """First frame on every (re)connection: who this worker is. ``incarnation`` names
    the process's coordinator for its whole life, so the authority applies each of its
    numbered frames once across reconnections, and a process that reuses a dead one's
    pid starts afresh."""

    worker: int
    pid: int
    incarnation: str


@dataclass(frozen=True, slots=True)
class Claimed(Frame):
    """A session was accepted (numbered, so the authority can acknowledge it)."""

    seq: int
    event: PresenceEvent


@dataclass(frozen=True, slots=True)
class Ended(Frame):
    """A session ended."""

    seq: int
    event: PresenceEvent
    forget: bool = False


@dataclass(frozen=True, slots=True)
class Noted(Frame):
    """An event for the presence log only."""

    event: PresenceEvent


@dataclass(frozen=True, slots=True)
class Routed(Frame):
    """A device's message, for the other workers' subscribers and persistent sessions.

    QoS 1 and 2 ones are numbered (``seq`` > 0) like a report, so one sent into a link
    that dropped is resent rather than lost after its PUBACK; QoS 0 ones are not (0)."""

    seq: int
    message: Publication
    origin: str = ""
    """The publisher's client id (for the No Local of its own persistent session)."""
    group: str = ""
    """A shared subscription's message a member left unacknowledged: for one member of
    that group elsewhere, and nobody else."""


@dataclass(frozen=True, slots=True)
class Filters(Frame):
    """Every topic filter this worker's subscribers hold (after a reconnection: what the
    authority knew of them went with the old link)."""

    filters: frozenset[str]


@dataclass(frozen=True, slots=True)
class FiltersChanged(Frame):
    """Filters this worker's subscribers came to hold (a first subscriber) or no longer
    hold (the last one left) since the last :class:`Filters` or :class:`FiltersChanged`."""

    added: frozenset[str]
    removed: frozenset[str]


@dataclass(frozen=True, slots=True)
class Resync(Frame):
    """After a reconnection: the sessions this worker holds now."""

    sessions: tuple[PresenceEvent, ...]


@dataclass(frozen=True, slots=True)
class Lookup(Frame):
    """Ask for a device's record."""

    request: int
    client_id: str


@dataclass(frozen=True, slots=True)
class Overview(Frame):
    """Ask for the registry's overview (the operator's page): counts and the latest ends
    of client ids containing ``query``, at most ``limit``."""

    request: int
    query: str
    limit: int


@dataclass(frozen=True, slots=True)
class BoxFigures(Frame):
    """A worker's ``$SYS/broker`` counts (:class:`.sys_figures.BrokerCounts`); answered in kind with the box's."""

    request: int
    values: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Settle(Frame):
    """Answer (:class:`Settled`) once every other worker has applied the filters this
    worker's earlier frames changed."""

    request: int


@dataclass(frozen=True, slots=True)
class Probed(Frame):
    """The answer to :class:`Probe`: every frame sent before it has been applied here."""

    token: int


@dataclass(frozen=True, slots=True)
class Drained(Frame):
    """Shutting down: this worker's devices have all ended and been reported."""


@dataclass(frozen=True, slots=True)
class OpenSession(Frame):
    """A CONNECT with CleanSession=0: the stored session, please (answered by :class:`SessionOpened`)."""

    request: int
    client_id: str
    username: str | None
    v5: bool = False
    """The client speaks MQTT 5.0: its session's messages are written so."""
    expiry: int | None = None
    """A new session's expiry, in seconds (None: the store's)."""
    create: bool = True
    """False: resume a stored session, but make none (MQTT 5's Session Expiry 0)."""


@dataclass(frozen=True, slots=True)
class Reported(Frame):
    """A change to a persistent session (numbered: resent until acknowledged)."""

    seq: int
    report: Report


@dataclass(frozen=True, slots=True)
class Kept(Frame):
    """A retained message to keep (an empty payload clears), from client ``owner``
    (whose share it counts against); numbered like a report."""

    seq: int
    topic: str
    payload: bytes
    qos: int
    owner: str = ""
    properties: bytes = b""


@dataclass(frozen=True, slots=True)
class WillHeld(Frame):
    """A delayed Will waits on the sending worker (kept by a durable store); numbered."""

    seq: int
    held: HeldWill


@dataclass(frozen=True, slots=True)
class WillDone(Frame):
    """The delayed Will session ``epoch`` of ``client_id`` left was sent or dropped; numbered."""

    seq: int
    client_id: str
    epoch: str


@dataclass(frozen=True, slots=True)
class WillsQuery(Frame):
    """Which delayed Wills a restart found waiting (answered by :class:`WillsFound`)."""

    request: int


@dataclass(frozen=True, slots=True)
class WillsFound(Frame):
    """The delayed Wills for the asking worker to wait out (the first worker gets them all)."""

    request: int
    wills: list[HeldWill]


@dataclass(frozen=True, slots=True)
class RetainedQuery(Frame):
    """A page of the retained messages a new subscription matches (answered by :class:`RetainedPage`)."""

    request: int
    topic_filter: str
    cursor: str | None


# -- authority to worker -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack(Frame):
    """Every numbered frame up to ``seq`` has been applied (and its events published);
    with a durable store in sync ``always``, committed too, unless ``durable`` is False
    (the commit failed: what they changed is kept in memory and retried)."""

    seq: int
    durable: bool = True


@dataclass(frozen=True, slots=True)
class Deliver(Frame):
    """A message for this worker's subscribers of its topic."""

    message: Publication
    group: str = ""
    """A shared subscription (``$share/...``) this worker serves the message to, chosen
    for it by the supervisor; empty: the worker's other subscribers only."""


@dataclass(frozen=True, slots=True)
class Evict(Frame):
    """Close this session: the device reconnected elsewhere."""

    client_id: str
    epoch: str
    detail: str


@dataclass(frozen=True, slots=True)
class Found(Frame):
    """The answer to a :class:`Lookup`."""

    request: int
    event: PresenceEvent | None


@dataclass(frozen=True, slots=True)
class OverviewFound(Frame):
    """The answer to :class:`Overview`: the overview as a JSON text (its shape is the
    page's business, not the link's)."""

    request: int
    body: str


@dataclass(frozen=True, slots=True)
class RemoteFilters(Frame):
    """Every filter the *other* workers' subscribers hold (routing is worth it only then)."""

    filters: frozenset[str]


@dataclass(frozen=True, slots=True)
class RemoteFiltersChanged(Frame):
    """Filters that the other workers' subscribers (or persistent sessions) came to hold,
    none of them before, or that none of them holds any more: applied to the last
    :class:`RemoteFilters`, each change costs what changed, not the whole set again."""

    added: frozenset[str]
    removed: frozenset[str]


@dataclass(frozen=True, slots=True)
class Probe(Frame):
    """Answer :class:`Probed` with ``token`` (a barrier: links deliver in order)."""

    token: int


@dataclass(frozen=True, slots=True)
class Settled(Frame):
    """The answer to :class:`Settle`."""

    request: int


@dataclass(frozen=True, slots=True)
class CloseSubscribers(Frame):
    """Shutting down: every worker has drained; subscribers may now be closed."""


@dataclass(frozen=True, slots=True)
class SessionOpened(Frame):
    """The answer to :class:`OpenSession`."""

    request: int
    present: bool
    subscriptions: tuple[tuple[str, int], ...]
    """(filter, granted QoS) pairs: a list, not a JSON object, so any filter text is safe."""
    inbound: frozenset[int]
    refused: bool = False
    """No session: the store keeps as many as it may (the CONNECT is refused, 3)."""
    options: tuple[tuple[str, int], ...] = ()
    """(filter, MQTT 5 options packed) pairs, for the filters that have any."""
    kept: bool = True
    """Whether a session is kept for the connection (not when none was stored and none was to be made)."""


@dataclass(frozen=True, slots=True)
class Transmit(Frame):
    """Packets for a persistent session's connection (``epoch``), if this worker holds it."""

    client_id: str
    epoch: str
    packets: list[bytes]
    v5: bool = False
    """The packets are written for MQTT 5.0 (else 3.1.1)."""


@dataclass(frozen=True, slots=True)
class RetainedPage(Frame):
    """The answer to :class:`RetainedQuery`: messages, and the cursor of the rest."""

    request: int
    messages: list[RetainedMessage]
    cursor: str | None


Numbered = Claimed | Ended | Reported | Kept | Routed | WillHeld | WillDone
"""Frames a worker numbers, keeps until acknowledged and resends after a dropped link."""

_TYPES: dict[str, type[Frame]] = {
    cls.__name__: cls
    for cls in (
        *(Hello, Claimed, Ended, Noted, Routed, Filters, FiltersChanged, Resync, Lookup, Drained),
        *(OpenSession, Reported, Kept, RetainedQuery, Settle, Probed, Overview, OverviewFound, BoxFigures),
        *(Ack, Deliver, Evict, Found, RemoteFilters, RemoteFiltersChanged, CloseSubscribers),
        *(SessionOpened, Transmit, RetainedPage, Probe, Settled, WillHeld, WillDone, WillsQuery, WillsFound),
    )
}

# Records carried inside frames, tagged by class name; their fields are checked on the way in.
_RECORDS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        *(Attach, Detach, Subscribed, Acked, AckedTogether, Inbound, Push, Discard, RetainedMessage, Publication),
        *(HeldWill, Will),
    )
}
_SCALARS = {"str": str, "int": int, "bytes": bytes, "bool": bool}


def _record_from_wire(value: dict[str, object]) -> object:
    name = value.pop("$record")
    cls = _RECORDS[str(name)]
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    if set(value) != set(fields):
        raise FrameError(f"{name}: fields {sorted(value)}, expected {sorted(fields)}")
    out = {k: _from_wire(v, fields[k]) for k, v in value.items()}
    for k, v in out.items():
        kinds = [_SCALARS[t.strip()] for t in fields[k].split("|") if t.strip() in _SCALARS]
        if kinds and not (isinstance(v, tuple(kinds)) or (v is None and "None" in fields[k])):
            raise FrameError(f"{name}.{k}: {type(v).__name__} is not {fields[k]}")
    try:
        return cls(**out)
    except ValueError as exc:  # a record that checks its own fields (AckedTogether's acks)
        raise FrameError(f"{name}: {exc}") from None


def _to_wire(value: object) -> object:
    if isinstance(value, PresenceEvent):
        # The exact time, not to_dict's milliseconds: the registry orders crossing
        # claims by it, and two workers' accepts can fall in the same millisecond.
        return {"$event": {**value.to_dict(), "time": value.time}}
    if isinstance(value, bytes):
        return {"$b64": base64.b64encode(value).decode()}
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_to_wire(v) for v in value]
    if type(value).__name__ in _RECORDS and dataclasses.is_dataclass(value):
        record: dict[str, object] = {"$record": type(value).__name__}
        for f in dataclasses.fields(value):
            record[f.name] = _to_wire(getattr(value, f.name))
        return record
    return value


def _from_wire(value: object, kind: str) -> object:
    if isinstance(value, dict):
        if "$event" in value:
            return PresenceEvent.from_dict(value["$event"])
        if "$b64" in value:
            return base64.b64decode(value["$b64"])
        if "$record" in value:
            return _record_from_wire(dict(value))
    if kind.startswith("frozenset[int]") and isinstance(value, list):
        return frozenset(int(v) for v in value)
    if kind.startswith("frozenset") and isinstance(value, list):
        return frozenset(str(v) for v in value)
    if kind.startswith("tuple") and isinstance(value, list):
        return tuple(_from_wire(v, kind[6:]) for v in value)  # nested tuples stay tuples
    if kind.startswith("list") and isinstance(value, list):
        return [_from_wire(v, "") for v in value]
    return value


def encode(frame: Frame) -> bytes:
    """One line, newline included."""
    body: dict[str, object] = {"type": type(frame).__name__}
    for f in dataclasses.fields(frame):
        body[f.name] = _to_wire(getattr(frame, f.name))
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Frame:
    """The frame on ``line``; :class:`FrameError` if it is not one."""
    try:
        body = json.loads(line)
        cls = _TYPES[body.pop("type")]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if set(body) - set(fields):
            raise FrameError(f"unexpected fields {sorted(set(body) - set(fields))} in {cls.__name__}")
        return cls(**{k: _from_wire(v, str(fields[k].type)) for k, v in body.items()})
    except FrameError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FrameError(f"not a frame: {line[:80]!r} ({exc})") from exc
