"""ASGI 3 for the HTTP server: the types, loading ``module:app``, the native interface
as an ASGI app, and the lifespan protocol.

The server speaks ASGI to every app: an app written for ``servers.http``'s own
``Request -> Response`` interface (:mod:`.app`) is wrapped by :func:`native_asgi`, so
there is one request cycle (:mod:`.exchange`) and one place where timeouts are kept.
Nothing here does I/O; the lifespan runner awaits only the app.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import trio

from .app import App, Request, Response

__all__ = [
    "ASGIApp",
    "Lifespan",
    "LifespanFailed",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "load_app",
    "native_asgi",
]

logger = logging.getLogger("servers.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""``async def app(scope, receive, send)``: an ASGI 3 application."""

ASGI_VERSION = {"version": "3.0", "spec_version": "2.4"}


def load_app(spec: str) -> ASGIApp:
    """The ASGI app named ``module:attribute`` (the attribute may be dotted), as
    uvicorn and hypercorn name it. Raises ``ValueError`` with a readable reason."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"an app is named module:attribute, not {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m uvicorn` does: the working directory's modules
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not callable(found):
        raise ValueError(f"{spec!r} is not callable")
    app: ASGIApp = found
    return app


def native_asgi(app: App, max_body_size: int | None = None) -> ASGIApp:
    """An app of the native interface (``async def app(request) -> Response``) as an
    ASGI app. The request body is read through ``receive()`` as the app asks for it,
    so the server's body timeout and size limit apply as to any ASGI app.
    """

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _no_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["raw_path"].decode("latin-1")
        query = scope["query_string"]
        target = path + ("?" + query.decode("latin-1") if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # http.disconnect: the body ends where the client did
                body = message.get("body", b"")
                if body:
                    yield body
                if not message.get("more_body", False):
                    return

        request = Request(scope["method"], target, headers, scope["http_version"], chunks)
        response: Response = await app(request)
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers],
            }
        )
        body = response.body
        if isinstance(body, bytes | bytearray):
            await send({"type": "http.response.body", "body": bytes(body)})
            return
        async for chunk in body:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    asgi.__qualname__ = f"native_asgi({getattr(app, '__qualname__', app)!s})"
    return asgi


async def _no_lifespan(receive: Receive, send: Send) -> None:
    # The native interface has no start-up or shutdown of its own: complete both.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


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
