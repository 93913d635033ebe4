"""A transport that does nothing, for the core benchmark (:mod:`benchmarks.core`): what
a watch wraps when only the watch's own cost may count."""

from __future__ import annotations

import trio

__all__ = ["NullStream"]


class NullStream(trio.abc.HalfCloseableStream):
    """A transport that is never read: the stamp is what is being timed."""

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        return None

    async def wait_send_all_might_not_block(self) -> None:
        return None

    async def send_eof(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
