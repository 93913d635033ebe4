"""Shared fixtures: every timing test runs under MockClock(autojump_threshold=0)."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import idlekeeper


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
async def keeper(clock: trio.testing.MockClock) -> AsyncIterator[idlekeeper.Keeper]:
    # pytest-trio only uses a clock the test itself requests: fail loudly if not.
    assert trio.lowlevel.current_clock() is clock, "request the `clock` fixture in the test"
    async with idlekeeper.open_keeper(tick=0.1) as k:
        yield k


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """A connected (server side, client side) pair over real loopback TCP."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listener.accept()
    await listener.aclose()
    return server, client


def wait_closed(sock: socket.socket, timeout: float) -> float:
    """Block until the server closes ``sock`` (reading and discarding); return when (monotonic)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic()
