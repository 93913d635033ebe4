"""The HTTP canary of ``python -m loadtest fuzz`` (:mod:`.canary`): one keep-alive
connection alternating ``GET /healthz`` and ``POST /echo``, each 200 with the right
body, and a new connection every :data:`~.canary_base.PROBE_INTERVAL` s that must get 200.
"""

from __future__ import annotations

import trio

from .canary_base import CANARY_LATENCY, Canary

__all__ = ["HTTP_KEEPALIVE_TIMEOUT", "HttpCanary"]

HTTP_KEEPALIVE_TIMEOUT = 2.0
"""The HTTP server's ``--keep-alive-timeout`` in a fuzz run (:data:`~.targets.HTTP_SERVER_ARGS`)."""


class HttpCanary(Canary):
    """A well-behaved HTTP client beside the fuzzer: on one keep-alive connection,
    ``GET /healthz`` and ``POST /echo`` in turn, each of which must be 200 (the echo
    intact), and a new connection every :data:`~.canary_base.PROBE_INTERVAL` s that
    must get 200."""

    def __init__(self, port: int, tag: str) -> None:
        super().__init__(port, tag, "http")

    async def _exchange(self, stream: trio.abc.Stream, request: bytes, buf: bytearray) -> tuple[int, bytes]:
        await stream.send_all(request)
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end >= 0:
                head = bytes(buf[:head_end]).lower()
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if len(buf) >= head_end + 4 + length:
                    status = int(head.split(b" ", 2)[1])
                    body = bytes(buf[head_end + 4 : head_end + 4 + length])
                    del buf[: head_end + 4 + length]
                    return status, body
            data = await stream.receive_some(65536)
            if not data:
                raise trio.BrokenResourceError("closed by the server")
            buf += data

    async def start(self, nursery: trio.Nursery) -> None:
        """Open the keep-alive connection and return once a first request on it was answered
        (the server holds it by then); then the requests go on, with the probes."""
        self.report.clients = 1
        stream = await self.open()
        buf = bytearray()
        with trio.fail_after(CANARY_LATENCY):
            status, _ = await self._exchange(stream, b"GET /healthz HTTP/1.1\r\nHost: canary\r\n\r\n", buf)
        if status != 200:
            raise RuntimeError(f"the canary's first request got {status}")
        nursery.start_soon(self._run, stream, buf)
        nursery.start_soon(self._probe)

    async def _run(self, stream: trio.abc.Stream, buf: bytearray) -> None:
        n = 0
        while not self.stopping:
            n += 1
            body = f"canary-{self.tag}-{n}".encode()
            if n % 2:
                request, expect = b"GET /healthz HTTP/1.1\r\nHost: canary\r\n\r\n", b"ok\n"
            else:
                request = b"POST /echo HTTP/1.1\r\nHost: canary\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                expect = body
            began = trio.current_time()
            try:
                with trio.fail_after(CANARY_LATENCY):
                    status, got = await self._exchange(stream, request, buf)
            except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as exc:
                if self.stopping:
                    return
                self.problem(f"request {n}: {exc!r}; connecting again")
                await stream.aclose()
                stream = await self.open()
                buf.clear()
                continue
            self.latency(trio.current_time() - began)
            if status != 200 or got != expect:
                self.problem(f"request {n}: status {status}, body {got[:40]!r}")
            else:
                self.report.exchanges += 1
            before = trio.current_time()
            await trio.sleep(0.05)
            # Silent as long as the server's keep-alive timeout: a close would be ours.
            self.gap(trio.current_time() - before, HTTP_KEEPALIVE_TIMEOUT)
        await stream.aclose()

    async def _probe_and_report(self, n: int) -> None:
        async def probe() -> str:
            stream = await self.open()
            try:
                request = b"GET / HTTP/1.1\r\nHost: canary\r\nConnection: close\r\n\r\n"
                status, _ = await self._exchange(stream, request, bytearray())
            finally:
                await stream.aclose()
            return "" if status == 200 else f"status {status}"

        await self._checked(n, probe)

    async def stop(self) -> None:
        """Stop after the request in flight."""
        self.stopping = True
        await trio.sleep(0.2)
