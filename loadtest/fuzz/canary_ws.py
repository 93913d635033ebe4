"""The WebSocket canary of ``python -m loadtest fuzz`` (:mod:`.canary`): one WebSocket
to the echo app, sending text and binary messages in turn, each echoed intact,
answering the server's pings; and a new WebSocket every
:data:`~.canary_base.PROBE_INTERVAL` s whose message is echoed and whose close is
answered with 1000.
"""

from __future__ import annotations

import trio

from .canary_base import CANARY_LATENCY, Canary
from .ws_stream import WsClientStream

__all__ = ["WS_PING_INTERVAL", "WS_PING_TIMEOUT", "WsCanary"]

WS_PING_INTERVAL = 1.0
WS_PING_TIMEOUT = 1.0
"""The HTTP server's ``--ws-ping-interval`` and ``--ws-ping-timeout`` in a fuzz run
(:data:`~.targets.WS_SERVER_ARGS`): a WebSocket silent that long is closed."""


class WsCanary(Canary):
    """A well-behaved WebSocket client beside the fuzzer: on one WebSocket to the echo
    app, a text and a binary message in turn, each of which must come back intact,
    the server's pings answered as they come; and a new WebSocket every
    :data:`~.canary_base.PROBE_INTERVAL` s whose message must come back and whose
    close (1000) must be answered."""

    def __init__(self, port: int, tag: str) -> None:
        super().__init__(port, tag, "ws")

    async def start(self, nursery: trio.Nursery) -> None:
        """Open the WebSocket and return once a first message came back on it; then the
        messages go on, with the probes."""
        self.report.clients = 1
        stream = await self.open_ws("/canary")
        with trio.fail_after(CANARY_LATENCY):
            await stream.send_message("hello")
            if await stream.receive_message() != "hello":
                raise RuntimeError("the canary's first message did not come back")
        echoes_in, echoes = trio.open_memory_channel[str | bytes | None](16)
        nursery.start_soon(self._read, stream, echoes_in)
        nursery.start_soon(self._run, stream, echoes)
        nursery.start_soon(self._probe)

    async def _read(self, stream: WsClientStream, echoes: trio.MemorySendChannel[str | bytes | None]) -> None:
        # Reading all the time: a ping is answered at once, whatever the writer waits for.
        while True:
            try:
                message = await stream.receive_message()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                message = None
            await echoes.send(message)
            if message is None:
                return

    async def _run(self, stream: WsClientStream, echoes: trio.MemoryReceiveChannel[str | bytes | None]) -> None:
        n = 0
        while not self.stopping:
            n += 1
            message: str | bytes = f"canary-{self.tag}-{n} é" if n % 2 else bytes(range(256)) * (n % 7)
            began = trio.current_time()
            try:
                with trio.fail_after(CANARY_LATENCY):
                    await stream.send_message(message)
                    got = await echoes.receive()
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                got = repr(exc)
            if got is None and self.stopping:
                return
            if got != message:
                self.problem(f"message {n}: {got!r:.60} came back (close {stream.close_code})")
                return  # the WebSocket is gone or out of step: the problem is noted
            self.latency(trio.current_time() - began)
            self.report.exchanges += 1
            before = trio.current_time()
            await trio.sleep(0.05)
            # Away as long as the server's ping window: a close would be ours.
            self.gap(trio.current_time() - before, WS_PING_INTERVAL + WS_PING_TIMEOUT)
        await stream.aclose()

    async def _probe_and_report(self, n: int) -> None:
        async def probe() -> str:
            stream = await self.open_ws(f"/probe/{n}")
            try:
                await stream.send_message(f"probe {n}")
                got = await stream.receive_message()
                await stream.close_handshake()
            finally:
                await stream.aclose()
            if got != f"probe {n}" or stream.close_code != 1000:
                return f"{got!r:.40} came back, close {stream.close_code}"
            return ""

        await self._checked(n, probe)

    async def stop(self) -> None:
        """Stop after the message in flight."""
        self.stopping = True
        await trio.sleep(0.2)
