"""ASGI apps that go on after their response, or watch for the client leaving: what
Starlette and FastAPI apps do (issue 59). Framework-neutral (anyio), so that uvicorn
(asyncio), hypercorn (trio) and servers.http serve the same app side by side.

What the apps saw is kept in :data:`seen` (for the in-process tests), and, when the
environment names a directory (``LIFECYCLE_DIR``), as one file a fact there (for the
servers run as processes)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from fastapi import BackgroundTasks, FastAPI
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from servers.http.asgi import Message, Receive, Scope, Send

seen: list[str] = []
"""Facts in the order they happened: ``background-done 3``, ``sse-ended``, ..."""


def note(fact: str) -> None:
    """Record ``fact`` here and, if ``LIFECYCLE_DIR`` is set, as a file there."""
    seen.append(fact)
    folder = os.environ.get("LIFECYCLE_DIR")
    if folder:
        (Path(folder) / fact.replace(" ", "_")).write_text(str(time.time()))


api = FastAPI()


@api.get("/bg")
async def background(tasks: BackgroundTasks, s: float = 3.0, n: int = 0) -> PlainTextResponse:
    """Answers at once; a background task (FastAPI's) then works ``s`` seconds."""

    async def work() -> None:
        note(f"background-started {n}")
        await anyio.sleep(s)
        note(f"background-done {n}")

    tasks.add_task(work)
    return PlainTextResponse("queued\n")


@api.get("/bg-starlette")
async def background_starlette(request: Request) -> PlainTextResponse:
    """Starlette's own BackgroundTask on a response."""
    seconds = float(request.query_params.get("s", "3"))

    async def work() -> None:
        await anyio.sleep(seconds)
        note("starlette-background-done")

    return PlainTextResponse("queued\n", background=BackgroundTask(work))


@api.get("/sse")
async def server_sent_events() -> StreamingResponse:
    """One event, then a long silence: what a dashboard's event stream does between events."""

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await anyio.sleep(60)
            yield b"data: late\n\n"
        finally:
            note("sse-ended")

    return StreamingResponse(events(), media_type="text/event-stream")


@api.get("/numbers")
async def numbers() -> StreamingResponse:
    async def count() -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"%d\n" % i

    return StreamingResponse(count(), media_type="text/plain")


@api.get("/spec")
async def spec(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(request.scope["asgi"].get("spec_version")))


async def _watch(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads its body, then answers while a task waits for ``http.disconnect`` (as
    Starlette's streaming responses do); returns only once that comes."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    async with anyio.create_task_group() as group:

        async def listen() -> None:
            message = await receive()
            note(f"watch-heard {message['type']}")

        group.start_soon(listen)
        await anyio.sleep(0.05)  # the listener waits in receive() by now
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"8")]})
        await send({"type": "http.response.body", "body": b"watched\n"})


async def _started(scope: Scope, receive: Receive, send: Send) -> None:
    """Starts a response and returns: nothing of it has gone out."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})


async def _partial(scope: Scope, receive: Receive, send: Send) -> None:
    """Sends the head and part of the body, and returns without finishing it."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})


async def _raise_after_leaving(scope: Scope, receive: Receive, send: Send) -> None:
    """Streams until a write fails (the client left), then raises as Starlette does."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    try:
        while True:
            await send({"type": "http.response.body", "body": b"x" * 1024, "more_body": True})
            await anyio.sleep(0.05)
    except OSError as exc:
        raise RuntimeError("the client disconnected") from exc


_RAW = {"/watch": _watch, "/started": _started, "/partial": _partial, "/raise-after-leaving": _raise_after_leaving}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The FastAPI app, and the raw ASGI apps above at their paths."""
    raw = _RAW.get(scope.get("path", ""))
    await (raw or api)(scope, receive, send)


async def failing_startup(scope: Scope, receive: Receive, send: Send) -> None:
    """An app whose lifespan start-up fails, as one whose database is down."""
    if scope["type"] == "lifespan":
        message: Message = await receive()
        assert message["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.failed", "message": "no database at db:5432"})


def facts(folder: Path) -> set[str]:
    """What the apps served by processes recorded in ``folder``."""
    return {path.name.replace("_", " ") for path in folder.iterdir()}


__all__ = ["app", "failing_startup", "facts", "note", "seen"]
