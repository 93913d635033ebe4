"""The operator's page: what it keeps of the registry (:mod:`servers.heartbeat.presence.overview`),
how it serves snapshots (:mod:`servers.page`, under MockClock), and what it shows of a
real server: one worker, and a box of two with a worker SIGKILLed.

The browser's side is in ``test_presence_page_browser.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from servers.heartbeat.coordination.frames import Overview, OverviewFound, decode, encode
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.presence.event import OFFLINE, ONLINE, REFUSED, PresenceEvent
from servers.heartbeat.presence.overview import INITIATORS, SEARCH_LIMIT, RecentEnds, initiator_of
from servers.http.app import Request
from servers.page import Page

from .redis_server import RedisServer
from .test_fleet import drain, fleet, until
from .test_fleet import redis_server as redis_server  # the fixture, used by name
from .test_heartbeat_clients import Server, raw_connect
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name


def event(status: str, client_id: str | None, reason: Offline | None = None, at: float = 1000.0) -> PresenceEvent:
    return PresenceEvent(status, client_id, "127.0.0.1:1", reason, silent_for=1.5, time=at, epoch=f"e-{client_id}")


# -- what is kept ------------------------------------------------------------------------


def test_every_reason_names_who_ended_the_session() -> None:
    assert set(INITIATORS) == set(Offline)
    assert initiator_of(Offline.KEEPALIVE_TIMEOUT) == "server"
    assert initiator_of(Offline.DISCONNECT) == "device"
    assert initiator_of(Offline.TAKEOVER) == "new-connection"
    assert initiator_of(Offline.WORKER_LOST) == "supervisor"
    assert initiator_of(Offline.NODE_LOST) == "fleet"


def test_recent_ends_keep_the_latest_offline_events_newest_first_and_bounded() -> None:
    recent = RecentEnds(kept=3, clock=lambda: 1000.0)
    recent(event(ONLINE, "a"))
    for i in range(5):
        recent(event(OFFLINE, f"dev-{i}", Offline.KEEPALIVE_TIMEOUT, at=1000.0 + i))
    recent(event(REFUSED, None, Offline.REFUSED))  # not presence
    recent(event(OFFLINE, None, Offline.CONNECT_TIMEOUT))  # never identified itself
    found = recent.search()
    assert [e["client_id"] for e in found] == ["dev-4", "dev-3", "dev-2"]
    first = found[0]
    assert first["reason"] == "keepalive-timeout" and first["initiator"] == "server"
    assert first["last_seen"] == pytest.approx(1004.0 - 1.5) and first["silent_for"] == 1.5
    assert recent.ends == {"keepalive-timeout": 5} and recent.sessions == 1


def test_recent_ends_search_by_client_id_in_any_case_within_the_limit() -> None:
    recent = RecentEnds(clock=lambda: 1000.0)
    for i in range(SEARCH_LIMIT + 50):
        recent(event(OFFLINE, f"Pump-{i}" if i % 2 else f"valve-{i}", Offline.CONNECTION_LOST))
    pumps = recent.search("pUMP", limit=10)
    assert len(pumps) == 10 and all(e["client_id"].startswith("Pump-") for e in pumps)
    assert pumps[0]["client_id"] == f"Pump-{SEARCH_LIMIT + 49}"
    assert len(recent.search("", limit=10**6)) == SEARCH_LIMIT
    assert recent.search("nobody") == []
    assert recent.search(since=2000.0) == []


def test_event_rates_count_whole_seconds() -> None:
    now = [100.2]
    recent = RecentEnds(clock=lambda: now[0])
    for _ in range(20):
        recent(event(ONLINE, "a"))
    for _ in range(5):
        recent(event(OFFLINE, "a", Offline.DISCONNECT))
    now[0] = 101.5  # the second 100 is over
    assert recent.rates(window=10) == (2.0, 0.5)
    now[0] = 200.0
    assert recent.rates(window=10) == (0.0, 0.0)


def test_the_overview_question_and_answer_cross_the_bus_intact() -> None:
    assert decode(encode(Overview(7, "pump", 50))) == Overview(7, "pump", 50)
    body = json.dumps({"online": 3, "recent": [{"client_id": "a\nb"}]})
    assert decode(encode(OverviewFound(7, body))) == OverviewFound(7, body)


# -- serving it --------------------------------------------------------------------------


class CountingSource:
    """A page source that counts the snapshots made."""

    def __init__(self) -> None:
        self.snapshots = 0

    async def snapshot(self, query: str, limit: int, authorization: str | None = None) -> dict[str, Any]:
        self.snapshots += 1
        return {"n": self.snapshots, "query": query, "limit": limit}

    def worker(self) -> dict[str, Any]:
        return {"worker": 0}


def get(path: str, *headers: tuple[str, str]) -> Request:
    async def nothing() -> AsyncIterator[bytes]:
        return
        yield b""

    return Request("GET", path, list(headers), "1.1", nothing)


async def test_ten_watchers_share_one_snapshot_a_second(autojump_clock: trio.testing.MockClock) -> None:
    source = CountingSource()
    page = Page(source, max_watchers=10)
    got: list[list[bytes]] = [[] for _ in range(10)]

    async def watch(i: int) -> None:
        response = await page.respond(get("/presence/stream"))
        assert response is not None and response.status == 200
        assert ("content-type", "text/event-stream") in response.headers
        assert not isinstance(response.body, bytes)
        stream = aiter(response.body)
        try:
            with trio.move_on_after(5.5):
                async for chunk in stream:
                    got[i].append(chunk)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(watch, i)
        await trio.sleep(0.5)
        assert page.watchers == 10
        refused = await page.respond(get("/presence/stream"))
        assert refused is not None and refused.status == 503
    assert page.watchers == 0  # each stream's end is counted
    assert source.snapshots == 6  # at 0, 1, ..., 5 s: one each, whoever asked first
    for chunks in got:
        data = [json.loads(c.split(b"data: ", 1)[1]) for c in chunks if c.startswith(b"event: snapshot")]
        assert [d["n"] for d in data] == [1, 2, 3, 4, 5, 6]


async def test_nobody_watching_costs_no_snapshot(autojump_clock: trio.testing.MockClock) -> None:
    source = CountingSource()
    Page(source)
    await trio.sleep(60)
    assert source.snapshots == 0


async def test_the_json_snapshot_takes_a_search_and_refuses_a_bad_limit() -> None:
    page = Page(CountingSource())
    found = await page.respond(get("/presence.json?q=pump%2D7&limit=20"))
    assert found is not None and found.status == 200 and isinstance(found.body, bytes)
    assert json.loads(found.body) == {"n": 1, "query": "pump-7", "limit": 20}
    for bad in ("?limit=x", "?limit=-1"):
        refused = await page.respond(get("/presence.json" + bad))
        assert refused is not None and refused.status == 400


async def test_the_page_takes_a_proxy_prefix_and_nothing_that_escapes_its_attribute() -> None:
    page = Page(CountingSource())

    async def index(*headers: tuple[str, str]) -> bytes:
        answer = await page.respond(get("/", *headers))
        assert answer is not None and answer.status == 200 and isinstance(answer.body, bytes)
        return answer.body

    assert b"<base" not in await index()
    assert b'<base href="/ops/mqtt/">' in await index(("x-forwarded-prefix", "/ops/mqtt"))
    assert b'<base href="/ops/">' in await index(("x-forwarded-prefix", "/ops/"))
    hostile = await index(("x-forwarded-prefix", '/x"><script>alert(1)</script>'))
    assert b"<base" not in hostile and b"alert(1)" not in hostile
    # Relative URLs only: nothing on the page starts at the server's root.
    assert b'src="/' not in await index() and b'href="/' not in await index()


async def test_static_files_are_served_with_a_validator_and_unknown_ones_are_404() -> None:
    page = Page(CountingSource())
    first = await page.respond(get("/static/chart.min.js"))
    assert first is not None and first.status == 200 and isinstance(first.body, bytes)
    assert first.body.startswith(b"/*!\n * Chart.js v3.9.1")
    etag = dict(first.headers)["etag"]
    again = await page.respond(get("/static/chart.min.js", ("if-none-match", etag)))
    assert again is not None and again.status == 304
    licence = await page.respond(get("/static/LICENSE.chart.js.txt"))
    assert licence is not None and isinstance(licence.body, bytes) and b"MIT License" in licence.body
    for missing in ("/static/nope.js", "/static/../__init__.py", "/static/index.html"):
        answer = await page.respond(get(missing))
        assert answer is not None and answer.status == 404
    assert await page.respond(get("/devices/x")) is None  # not the page's: the status app's


# -- a real server -----------------------------------------------------------------------


def fetch(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return json.loads(answer.read())


def wait_until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_one_worker_page_counts_devices_and_lists_a_silent_one_with_its_reason(start_server: Any) -> None:
    server: Server = start_server(status=True)
    status = server.status_port
    assert status is not None
    healthy = [raw_connect(server.port, f"healthy-{i}", keep_alive=60) for i in range(3)]
    silent = raw_connect(server.port, "silent-1", keep_alive=1)  # open, and never a packet more
    online = wait_until(lambda: fetch(status, "/presence.json")["registry"]["online"] == 4)
    assert online, fetch(status, "/presence.json")
    gone = server.wait_for(lambda e: e.get("client_id") == "silent-1" and e["status"] == "offline", timeout=5)

    def listed() -> Any:
        snapshot = fetch(status, "/presence.json")
        return snapshot if snapshot["registry"]["recent"] else None

    snapshot = wait_until(listed)
    registry = snapshot["registry"]
    assert registry["scope"] == "worker" and registry["online"] == 3 and registry["records"] == 4
    (entry,) = registry["recent"]
    assert entry["client_id"] == "silent-1" and entry["reason"] == "keepalive-timeout"
    assert entry["initiator"] == "server" and entry["epoch"] == gone[0]["epoch"]
    assert 1.5 <= entry["silent_for"] < 1.5 + 0.2  # its deadline, at most a tick (0.05 s) and a bit late
    (worker,) = snapshot["workers"]
    assert worker["online"] == 3 and worker["lateness"]["count"] == 1
    assert snapshot["lateness"]["count"] == 1 and snapshot["tick"] == 0.05
    # The device's own record, where the list links to.
    assert fetch(status, "/devices/silent-1")["reason"] == "keepalive-timeout"
    assert fetch(status, "/presence.json?q=SILENT")["registry"]["recent"][0]["client_id"] == "silent-1"
    assert fetch(status, "/presence.json?q=healthy")["registry"]["recent"] == []
    for sock in [*healthy, silent]:
        sock.close()


def test_a_box_page_shows_every_worker_and_the_ends_the_supervisor_declared(start_server: Any) -> None:
    server: Server = start_server(workers=2, status=True)
    status = server.status_port
    assert status is not None
    socks = [raw_connect(server.port, f"box-{i}", keep_alive=60) for i in range(12)]

    def both() -> Any:
        snapshot = fetch(status, "/presence.json")
        workers = snapshot["workers"]
        ok = snapshot["registry"]["online"] == 12 and len(workers) == 2 and all(w.get("pid") for w in workers)
        return snapshot if ok else None

    snapshot = wait_until(both)
    assert snapshot, fetch(status, "/presence.json")
    assert snapshot["registry"]["scope"] == "box"
    # The other worker's page tells the same registry.
    assert fetch(status + 1, "/presence.json")["registry"]["online"] == 12
    workers = {w["worker"]: w for w in snapshot["workers"]}
    assert sum(w["online"] for w in workers.values()) == 12
    victim = max(workers.values(), key=lambda w: w["online"])
    held = victim["online"]
    assert held > 0
    os.kill(victim["pid"], signal.SIGKILL)

    def lost() -> Any:
        port = status if victim["worker"] == 1 else status + 1
        snap = fetch(port, "/presence.json")
        ends = [e for e in snap["registry"]["recent"] if e["reason"] == "worker-lost"]
        return snap if len(ends) == held else None

    after = wait_until(lost)
    assert after, "the worker's devices were not listed worker-lost"
    assert {e["initiator"] for e in after["registry"]["recent"]} == {"supervisor"}
    assert after["registry"]["online"] == 12 - held
    assert after["registry"]["ends"] == {"worker-lost": held}
    for sock in socks:
        sock.close()


async def test_a_fleet_page_counts_online_devices_in_redis_and_lists_every_nodes_ends(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        for i in range(4):
            a.online(f"a-{i}", f"ea{i}")
        for i in range(3):
            b.online(f"b-{i}", f"eb{i}")
        await drain(a, b, c)
        found = await c.coord.overview()
        assert found is not None
        assert found["scope"] == "fleet" and found["online"] == 7 and found["records"] is None
        assert found["nodes"] == ["a", "b", "c"]
        b.offline("b-0", "eb0", Offline.KEEPALIVE_TIMEOUT)
        a.scope.cancel()  # a crashes: its devices end node-lost, declared by b or c
        await until(lambda: len(c.coord.recent.recent) == 5)
        # The sweep ends a's sessions, then drops a from the members: wait for both.
        with trio.fail_after(5):
            while (found := await c.coord.overview()) is None or found["nodes"] != ["b", "c"]:  # noqa: ASYNC110 (Redis, polled)
                await trio.sleep(0.01)
        assert found["online"] == 2 and found["nodes"] == ["b", "c"]
        reasons = sorted((e["client_id"], e["reason"], e["initiator"]) for e in found["recent"])
        assert reasons == [(f"a-{i}", "node-lost", "fleet") for i in range(4)] + [
            ("b-0", "keepalive-timeout", "server")
        ]
        # Every node lists the same ends: each reads every event once.
        assert [e["epoch"] for e in (await b.coord.overview("a-", 10) or {})["recent"]] == [
            e["epoch"] for e in found["recent"] if e["client_id"].startswith("a-")
        ]


def test_each_gateways_page_counts_the_fleet_and_lists_a_device_that_died_on_another(
    start_server: Any, redis_server: RedisServer
) -> None:
    gateways: list[Server] = [
        start_server("--cluster", redis_server.url, "--node", f"gw{i}", status=True) for i in range(2)
    ]
    statuses = [g.status_port for g in gateways]
    assert None not in statuses
    socks = [
        raw_connect(g.port, f"{name}-{i}", keep_alive=60)
        for g, name in zip(gateways, "ab", strict=True)
        for i in range(3)
    ]
    silent = raw_connect(gateways[1].port, "b-silent", keep_alive=1)

    def seen_everywhere() -> Any:
        snapshots = [fetch(int(port or 0), "/presence.json") for port in statuses]
        ok = all(s["registry"] and s["registry"]["recent"] for s in snapshots)
        return snapshots if ok else None

    snapshots = wait_until(seen_everywhere)
    assert snapshots, [fetch(int(port or 0), "/presence.json") for port in statuses]
    for snapshot in snapshots:
        registry = snapshot["registry"]
        assert registry["scope"] == "fleet" and registry["online"] == 6 and registry["records"] is None
        assert len(registry["nodes"]) == 2
        (entry,) = registry["recent"]
        assert (entry["client_id"], entry["reason"], entry["initiator"]) == ("b-silent", "keepalive-timeout", "server")
        (worker,) = snapshot["workers"]
        assert worker["node"].startswith(("gw0/", "gw1/"))
    assert {s["workers"][0]["node"].split("/")[0] for s in snapshots} == {"gw0", "gw1"}
    for sock in [*socks, silent]:
        sock.close()
