"""The ASGI lifespan protocol: an app's start-up before the first request, and its
shutdown after the last.

:class:`Lifespan` runs the app's ``lifespan`` call in a task of its own and speaks to
it through two small channels; it awaits only the app, never a socket.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from .asgi import ASGI_VERSION, ASGIApp, Message, Scope

__all__ = ["Lifespan", "LifespanFailed"]

logger = logging.getLogger("servers.http")


class LifespanFailed(RuntimeError):
    """The app reported ``lifespan.startup.failed`` (or raised during start-up)."""


class Lifespan:
    """Runs an app's lifespan protocol in a task: :meth:`startup` before the first
    request, :meth:`shutdown` after the last one has finished.

    An app that does not speak lifespan (it raises on the scope, or returns at once)
    is served without it, as uvicorn's ``--lifespan auto`` does. ``state`` is the
    dictionary the app may fill at start-up; each request's scope gets a shallow copy
    (the ASGI lifespan-state extension, which Starlette uses).
    """

    def __init__(self, app: ASGIApp, *, timeout: float = 30.0) -> None:
        self.app = app
        self.timeout = timeout
        self.state: dict[str, Any] = {}
        self.supported = True
        self._to_app_send, self._to_app = trio.open_memory_channel[Message](2)
        self._from_app_send, self._from_app = trio.open_memory_channel[Message](2)
        self._done = trio.Event()
        self._started = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The app's lifespan call; start it with ``nursery.start`` and then call :meth:`startup`."""
        scope: Scope = {"type": "lifespan", "asgi": dict(ASGI_VERSION), "state": self.state}
        task_status.started()
        try:
            await self.app(scope, self._receive, self._send)
        except Exception as exc:
            if not self._started:
                # Raised before it took part: an app without lifespan support.
                self.supported = False
                logger.info("http: the app does not support lifespan (%r); serving without it", exc)
            else:
                logger.exception("http: the app's lifespan raised")
                await self._from_app_send.send({"type": "lifespan.error", "message": repr(exc)})
        else:
            if not self._started:
                self.supported = False
        finally:
            self._done.set()

    async def _receive(self) -> Message:
        self._started = True
        return await self._to_app.receive()

    async def _send(self, message: Message) -> None:
        await self._from_app_send.send(message)

    async def _step(self, kind: str) -> None:
        if not self.supported:
            return
        with trio.move_on_after(math.inf if self.timeout is None else self.timeout) as scope:
            await self._to_app_send.send({"type": f"lifespan.{kind}"})
            async with trio.open_nursery() as nursery:
                answer: list[Message] = []

                async def listen() -> None:
                    answer.append(await self._from_app.receive())
                    nursery.cancel_scope.cancel()

                async def finished() -> None:
                    await self._done.wait()
                    await trio.lowlevel.checkpoint()  # an answer sent just before returning goes first
                    nursery.cancel_scope.cancel()

                nursery.start_soon(listen)
                nursery.start_soon(finished)
        if scope.cancelled_caught:
            raise LifespanFailed(f"lifespan {kind} did not complete in {self.timeout} s")
        if not answer:
            if not self.supported:
                return  # it returned at once: no lifespan after all
            raise LifespanFailed(f"the app's lifespan ended during {kind}")
        kind_done = answer[0].get("type", "")
        if kind_done == f"lifespan.{kind}.complete":
            return
        raise LifespanFailed(str(answer[0].get("message", kind_done)) or kind_done)

    async def startup(self) -> None:
        """Send ``lifespan.startup`` and wait for the app; raises :class:`LifespanFailed`."""
        await self._step("startup")

    async def shutdown(self) -> None:
        """Send ``lifespan.shutdown`` and wait for the app (errors are logged, not raised)."""
        if self._done.is_set():
            return
        try:
            await self._step("shutdown")
        except LifespanFailed as exc:
            logger.error("http: lifespan shutdown failed: %s", exc)
