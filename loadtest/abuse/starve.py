"""``status-starve``: every connection the status port allows, held idle from one
address and renewed before its idle timeout, so that ``/healthz`` has no room left.

The status endpoint takes 256 connections (:data:`servers.status.STATUS_CONFIG`) and
closes an idle one after 10 s; the attacker opens a few more than that and renews
each every :data:`RENEW` s. The healthy fleet's /healthz polls must still be answered
200. Mosquitto has no status port.
"""

from __future__ import annotations

import contextlib

import trio

from servers.status import STATUS_CONFIG

from .attack import ATTACKER, Attack, Scene
from .client import open_socket

__all__ = ["StatusStarve"]

RENEW = 8.0
"""Seconds between renewals: under the status endpoint's 10 s idle timeout."""
ANSWERED_WITHIN = 0.2
"""Seconds to see whether the new connections were answered at once (refused with a status)."""


class StatusStarve(Attack):
    """The status port's connections held idle, renewed every :data:`RENEW` s."""

    name = "status-starve"
    summary = f"{STATUS_CONFIG.max_connections}+ idle connections to the status port, renewed every {RENEW:g} s"
    unit = "connection"
    per_unit = 16384.0
    not_for_mosquitto = "no status port"
    extra = 16
    """Connections beyond the status endpoint's cap."""

    async def run(self, scene: Scene) -> None:
        """Open the connections, hold them, renew them, until time's up."""
        port = scene.status_port
        if port is None:
            raise RuntimeError("status-starve needs the server's status port")
        held: list[trio.SocketStream] = []
        try:
            with trio.move_on_after(scene.seconds):
                while True:
                    await self._fill(port, held, scene)
                    await trio.sleep(RENEW)
                    for stream in held:
                        stream.socket.close()
                    held.clear()
        finally:
            for stream in held:
                stream.socket.close()

    async def _fill(self, port: int, held: list[trio.SocketStream], scene: Scene) -> None:
        opened: list[trio.SocketStream] = []
        for _ in range(STATUS_CONFIG.max_connections + self.extra):
            try:
                opened.append(await open_socket(port, ATTACKER))
            except (OSError, trio.TooSlowError):
                scene.answer("connect-failed")
        replies: dict[int, bytes] = {}

        async def answered(i: int, stream: trio.SocketStream) -> None:
            with trio.move_on_after(ANSWERED_WITHIN), contextlib.suppress(trio.BrokenResourceError, OSError):
                replies[i] = await stream.receive_some(64)

        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(opened):
                nursery.start_soon(answered, i, stream)
        for i, stream in enumerate(opened):
            reply = replies.get(i)
            if reply is None:
                scene.answer("held")
                held.append(stream)
                continue
            parts = reply.split(b" ", 2)
            scene.answer(f"http-{parts[1].decode(errors='replace')}" if len(parts) > 1 else "closed")
            stream.socket.close()
        scene.outcome.units = max(scene.outcome.units, len(held))
