"""The fleet's stream reader passes over a session's second online or second end
(issue 66): what a failover's re-claim or reconcile writes again for a store that
lost it. Pure: entries handed to the reader as XREAD returns them, no Redis."""

from __future__ import annotations

import json
from typing import Any

from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.metrics import FleetCounts
from servers.heartbeat.coordination.fleet.reader import STARTS_REMEMBERED, StreamReader
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX
from servers.heartbeat.presence.event import PresenceEvent

from .coordinator_cluster import RecordingHost


class _Shares:
    def owned(self, topic: str, key: str) -> tuple[str, ...]:
        return ()


class _Filters:
    shares = _Shares()


def _reader() -> tuple[StreamReader, list[PresenceEvent]]:
    logged: list[PresenceEvent] = []
    keys = FleetKeys("idlekeeper:", "gw0")
    reader = StreamReader(
        None,  # type: ignore[arg-type]  # no Redis: entries are handed over
        keys,
        FleetCounts(),
        _Filters(),  # type: ignore[arg-type]
        node="gw0",
        sinks=[logged.append],
        presence_prefix=DEFAULT_PRESENCE_PREFIX,
        moved_on=lambda: None,
    )
    return reader, logged


def _entry(client_id: str, epoch: str, status: str, *, reclaim: bool = False) -> dict[bytes, bytes]:
    event = {"status": status, "client_id": client_id, "epoch": epoch, "time": 1.0, "keep_alive": 30}
    if status == "offline":
        event["reason"] = "connection-lost"
    fields = {b"event": json.dumps(event).encode(), b"origin": b"gw0", b"evict": b""}
    if reclaim:
        fields[b"reclaim"] = b"1"
    return fields


def _feed(reader: StreamReader, host: RecordingHost, *entries: dict[bytes, bytes]) -> None:
    for fields in entries:
        reader._handle_entry(host, fields)


def test_a_second_online_of_a_session_is_passed_over_and_counted() -> None:
    reader, logged = _reader()
    host = RecordingHost(0)
    _feed(reader, host, _entry("a", "e1", "online"), _entry("a", "e1", "online", reclaim=True))
    assert [(e.client_id, e.status) for e in logged] == [("a", "online")]
    assert len(host.delivered) == 1
    assert (reader.counts.repeated_onlines, reader.counts.reclaimed_onlines) == (1, 0)


def test_an_online_after_its_session_ended_is_passed_over() -> None:
    reader, logged = _reader()
    host = RecordingHost(0)
    _feed(reader, host, _entry("a", "e1", "online"), _entry("a", "e1", "offline"), _entry("a", "e1", "online"))
    assert [e.status for e in logged] == ["online", "offline"]


def test_a_reclaimed_online_it_never_read_is_delivered_and_counted() -> None:
    reader, logged = _reader()
    host = RecordingHost(0)
    _feed(reader, host, _entry("b", "e2", "online", reclaim=True))
    assert [e.client_id for e in logged] == ["b"]
    assert reader.counts.reclaimed_onlines == 1


def test_a_new_session_of_the_same_device_is_not_a_copy() -> None:
    reader, logged = _reader()
    host = RecordingHost(0)
    _feed(reader, host, _entry("a", "e1", "online"), _entry("a", "e1", "offline"), _entry("a", "e2", "online"))
    assert [(e.epoch, e.status) for e in logged] == [("e1", "online"), ("e1", "offline"), ("e2", "online")]


def test_the_memory_of_starts_is_bounded() -> None:
    reader, _ = _reader()
    host = RecordingHost(0)
    for i in range(STARTS_REMEMBERED + 10):
        reader._handle_entry(host, _entry(f"d{i}", f"e{i}", "online"))
    assert len(reader.started) == STARTS_REMEMBERED


def test_a_stream_that_stops_short_at_an_entry_it_read_is_recognised() -> None:
    """A replica promoted without the old primary's last writes: its top is one of ours."""
    reader, _ = _reader()
    host = RecordingHost(0)
    stream = next(iter(reader.presence_streams))
    read: list[Any] = [_entry("a", "e1", "online"), _entry("b", "e2", "online"), _entry("a", "e1", "offline")]
    _feed(reader, host, *read)
    assert reader._read_already(stream, read[1])
    assert reader._read_already(stream, read[2])
    assert not reader._read_already(stream, _entry("c", "e3", "online"))  # a store that came back other
    assert not reader._read_already("idlekeeper:routes", read[1])
