"""What every canary of ``python -m loadtest fuzz`` shares (:mod:`.canary`): its report
and the addresses its connections had, problems noted with when they happened,
replies timed against :data:`CANARY_LATENCY`, its own pauses measured (a pause as
long as the server's keep-alive window voids its verdict), and a probe every
:data:`PROBE_INTERVAL` s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from .connection import peer_name
from .observation import CanaryReport
from .ws_stream import WsClientStream

__all__ = ["CANARY_LATENCY", "MAX_PROBLEMS", "PROBE_INTERVAL", "Canary"]

CANARY_LATENCY = 5.0
"""A reply slower than this is a canary problem (the server stalled)."""
PROBE_INTERVAL = 1.0
MAX_PROBLEMS = 20


class Canary:
    """What every canary shares: its report, the addresses its connections had, its
    problems noted, its replies and its own pauses timed, and a probe every
    :data:`PROBE_INTERVAL` s (each kind says what a probe is)."""

    def __init__(self, port: int, tag: str, kind: str) -> None:
        self.port = port
        self.tag = tag
        self.report = CanaryReport(kind)
        self.peers: set[str] = set()
        self.stopping = False
        self.began = trio.current_time()

    def problem(self, text: str) -> None:
        """Note a problem, with when it happened (seconds since the canary started)."""
        self.report.problem_count += 1
        if len(self.report.problems) < MAX_PROBLEMS:
            self.report.problems.append(f"{text} (at {trio.current_time() - self.began:.0f} s)")

    def gap(self, seconds: float, limit: float) -> None:
        """The canary's own loop was away ``seconds``; at ``limit`` its verdict is void."""
        if seconds > self.report.max_gap:
            self.report.max_gap = seconds
            if seconds >= limit:
                self.problem(f"the canary itself was starved for {seconds:.1f} s, its check is void")

    async def open(self) -> trio.abc.Stream:
        """A TCP connection to the server's port."""
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        self.peers.add(peer_name(stream.socket))
        return stream

    async def open_ws(self, path: str, subprotocols: Sequence[str] = ()) -> WsClientStream:
        """A WebSocket (its handshake done) to ``path`` on the server's port."""
        stream = await WsClientStream.connect(self.port, path, subprotocols)
        self.peers.add(peer_name(stream.socket))
        return stream

    def latency(self, seconds: float) -> None:
        """A reply took ``seconds``: the slowest is kept, past :data:`CANARY_LATENCY` a problem."""
        self.report.max_latency = max(self.report.max_latency, seconds)
        if seconds > CANARY_LATENCY:
            self.problem(f"a reply took {seconds:.1f} s")

    async def _probe(self) -> None:
        """A new connection every :data:`PROBE_INTERVAL` s until the canary stops."""
        n = 0
        while not self.stopping:
            await trio.sleep(PROBE_INTERVAL)
            n += 1
            await self._probe_and_report(n)

    async def _probe_and_report(self, n: int) -> None:
        """Open probe ``n``; count it and note any problem with it."""
        raise NotImplementedError

    async def _checked(self, n: int, probe: Callable[[], Awaitable[str]]) -> None:
        """Run probe ``n`` within :data:`CANARY_LATENCY`: counted if it ran, a problem if it
        failed or says one (it says nothing when all went well)."""
        try:
            with trio.fail_after(CANARY_LATENCY):
                said = await probe()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.problem(f"probe {n}: {exc!r}")
            return
        self.report.probes += 1
        if said:
            self.problem(f"probe {n}: {said}")
