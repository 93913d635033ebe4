"""A fleet node's Redis link (servers.heartbeat.coordination.fleet.link) when its
connection goes silent: packets dropped on the way, as in a partition, or a NAT or
firewall that forgot the flow. The connection stays open and nothing comes back.

A call that times out must not leave the client's later calls queued behind it on
that connection: after a partition, TCP retransmits there with a backoff that grows to
minutes, and a node that kept the connection would hear Redis again only then (a
fleet test once waited past its 15 s for a healed gateway to fence its sessions).
These run on the real clock, against a real redis-server, through a proxy that can
silence the connections it holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import coredis
import pytest
import trio

from servers.heartbeat.coordination.fleet.link import RedisLink
from servers.heartbeat.coordination.fleet.pools import SlotKeepingPool

from .redis_server import RedisServer
from .test_fleet import redis_server

__all__ = ["redis_server"]  # the fixture test_fleet.py makes, used here too

TIMEOUT = 0.5


class SilencingProxy:
    """Forwards loopback TCP connections to ``port``; :meth:`silence` stops the ones it
    holds from passing anything either way, without closing them, while connections
    made afterwards are forwarded as before. :meth:`black_hole` makes new connections
    hang in their connect, as when the SYN is lost."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = 0
        self.accepted = 0
        self._silenced: list[trio.CancelScope] = []
        self._accepting = trio.Event()
        self._accepting.set()
        self._fillers: list[trio.socket.SocketType] = []

    def silence(self) -> None:
        """Stop forwarding on every connection held now (they stay open)."""
        for scope in self._silenced:
            scope.cancel()
        self._silenced.clear()

    async def black_hole(self) -> None:
        """Stop accepting and fill the listen queue: the kernel then drops every new
        connection's SYN, and its connect waits (TCP retries the SYN for minutes)."""
        self._accepting = trio.Event()
        for _ in range(8):
            sock = trio.socket.socket()
            self._fillers.append(sock)
            with trio.move_on_after(0.2) as waited:
                await sock.connect(("127.0.0.1", self.port))
            if waited.cancelled_caught:
                return  # the queue is full
        raise AssertionError("the listen queue never filled")

    def open_up(self) -> None:
        """Accept again (the queued connections first)."""
        for sock in self._fillers:
            sock.close()
        self._fillers.clear()
        self._accepting.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # A listen queue of one: the fewest connections fill it (see black_hole).
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=1)
        self.port = listener.socket.getsockname()[1]
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                await self._accepting.wait()
                stream = await listener.accept()
                if self._accepting.is_set():
                    nursery.start_soon(self._forward, stream)
                else:
                    await stream.aclose()  # taken as the black hole began

    async def _forward(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        server = await trio.open_tcp_stream("127.0.0.1", self.target)
        scope = trio.CancelScope()
        self._silenced.append(scope)
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, server)
                nursery.start_soon(_pump, server, client)
        # Silenced: both ends stay open, and what they send is never read.
        await trio.sleep_forever()


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    async for data in source:
        await sink.send_all(data)


@asynccontextmanager
async def proxied(redis_server: RedisServer) -> AsyncIterator[tuple[SilencingProxy, RedisLink]]:
    async with trio.open_nursery() as nursery:
        proxy = SilencingProxy(redis_server.port)
        await nursery.start(proxy.serve)
        link = RedisLink(f"redis://127.0.0.1:{proxy.port}/0", "n1", timeout=TIMEOUT, renew=0.2)
        async with link.connect():
            yield proxy, link
        nursery.cancel_scope.cancel()


async def test_a_call_that_timed_out_is_not_followed_on_its_silent_connection(redis_server: RedisServer) -> None:
    with trio.fail_after(20):
        async with proxied(redis_server) as (proxy, link):
            await link.call(link.redis().set("k", "before"))
            assert link.connected and proxy.accepted == 1

            proxy.silence()
            with pytest.raises(trio.TooSlowError) as lost:
                await link.call(link.redis().get("k"))
            link.failed(lost.value)
            assert not link.connected and link.unreachable.is_set()

            # The next call is answered at once, on a new connection.
            assert await link.call(link.redis().get("k")) == b"before"
            assert link.connected and proxy.accepted == 2


async def test_a_failure_that_is_an_answer_keeps_the_connection(redis_server: RedisServer) -> None:
    """An error Redis answered (a script's, a wrong type) says nothing against the
    connection: it stays, and the calls go on on it."""
    with trio.fail_after(20):
        async with proxied(redis_server) as (proxy, link):
            redis = link.redis()
            await link.call(redis.set("k", "a string"))
            with pytest.raises(coredis.exceptions.ResponseError, match="wrong kind of value") as refused:
                await link.call(redis.lpush("k", ["x"]))
            link.failed(refused.value)
            assert await link.call(redis.get("k")) == b"a string"
            assert proxy.accepted == 1


# -- the pool's slots ---------------------------------------------------------------


@asynccontextmanager
async def small_pool(redis_server: RedisServer) -> AsyncIterator[tuple[SilencingProxy, SlotKeepingPool, Any]]:
    """A client on a pool of two slots, through a proxy: losing a slot shows at once."""
    async with trio.open_nursery() as nursery:
        proxy = SilencingProxy(redis_server.port)
        await nursery.start(proxy.serve)
        url = f"redis://127.0.0.1:{proxy.port}/0"
        pool = SlotKeepingPool.from_url(url, max_connections=2, connect_timeout=5.0, stream_timeout=5.0)
        assert isinstance(pool, SlotKeepingPool)
        async with coredis.Redis(connection_pool=pool) as client:
            yield proxy, pool, client
        nursery.cancel_scope.cancel()


async def test_a_connection_that_dies_while_held_gives_its_slot_back(redis_server: RedisServer) -> None:
    """A blocking read cancelled on its timeout (so its connection is closed while the
    read holds it), again and again: with coredis's own pool each time lost a slot,
    and after two the client waited forever for one."""
    with trio.fail_after(30):
        async with small_pool(redis_server) as (_, pool, client):
            for _ in range(5):
                with trio.move_on_after(0.3) as waited:
                    await client.xread({"a-stream": "$"}, block=10_000)
                assert waited.cancelled_caught
                with trio.fail_after(2):
                    assert await client.ping() == b"PONG"
            assert pool.free_slots == 2


async def test_a_call_cancelled_while_its_connect_waits_gives_its_slot_back(redis_server: RedisServer) -> None:
    """Redis unreachable, SYNs lost: each call is cancelled while its connection is
    being made. With coredis's own pool each such call lost its slot, and after two
    the client waited forever for one, even once Redis could be reached again."""
    with trio.fail_after(30):
        async with small_pool(redis_server) as (proxy, pool, client):
            assert await client.ping() == b"PONG"
            await proxy.black_hole()
            for _ in range(5):
                pool.disconnect()  # what the link does after a timeout: the next call connects anew
                with trio.move_on_after(0.3) as waited:
                    await client.ping()
                assert waited.cancelled_caught
            assert pool.free_slots == 2
            proxy.open_up()
            with trio.fail_after(5):
                assert await client.ping() == b"PONG"
