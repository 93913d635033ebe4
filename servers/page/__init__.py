"""The operator's live page, served on a status port beside ``/metrics``.

- ``/``: the page (plain HTML, a little JavaScript, and Chart.js, vendored with its
  licence in ``static/``; nothing is fetched from anywhere else, and there is no
  build step).
- ``/presence/stream``: server-sent events, one snapshot a second while anyone
  watches. The snapshot is made once per second and shared by every watcher, so ten
  pages cost what one does; with none, nothing is made at all. At most
  :data:`MAX_WATCHERS` streams are kept per worker; the next is answered 503 and the
  page falls back to its plain poll.
- ``/presence.json``: the same snapshot for scripts, and for the page where a proxy
  cuts the stream; ``?q=<text>`` searches the recent ends by client id, ``?limit=N``.
- ``/presence/worker.json``: one worker's own figures, which the box's other workers
  ask for.

Every URL the page uses is relative, so it works behind a reverse proxy that serves
it under a path prefix; one that sends ``X-Forwarded-Prefix`` also makes the page
work when opened without its trailing slash.

What a snapshot holds is the :class:`PageSource`'s business (the heartbeat server's
is :class:`servers.heartbeat.server.dashboard.Dashboard`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs

import trio

from ..http.app import Request, Response

__all__ = ["MAX_WATCHERS", "PERIOD", "Page", "PageSource"]

PERIOD = 1.0
"""Seconds between two snapshots pushed to a watcher: the issue's "at most once a second"."""

MAX_WATCHERS = 32
"""Streams one worker keeps open at once; beyond, the page polls ``/presence.json``."""

DEFAULT_LIMIT = 100
"""Recent ends a snapshot lists unless ``?limit`` says otherwise."""

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".png": "image/png",
}
# What a path prefix from a proxy may hold: a path, and nothing that could leave the
# attribute it is written into.
_PREFIX = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*$")


class PageSource(Protocol):
    """What the page shows: snapshots, and one worker's own figures."""

    async def snapshot(self, query: str, limit: int, authorization: str | None = None) -> dict[str, Any]:
        """A JSON-ready snapshot; ``query`` and ``limit`` narrow its list of recent ends.
        ``authorization``: the asking request's header, for whatever the source asks in
        turn (the box's other workers want the same bearer token)."""
        ...

    def worker(self) -> dict[str, Any]:
        """This worker's own figures, JSON-ready."""
        ...


class _Shared:
    """The latest snapshot's JSON, made again at most once a ``period`` by whichever
    watcher asks first; the others take the same bytes."""

    def __init__(self, source: PageSource, period: float) -> None:
        self.source = source
        self.period = period
        self.made = 0
        """Snapshots made for watchers so far."""
        self._lock = trio.Lock()
        self._body = b""
        self._at = -math.inf

    def due(self) -> float:
        """When the next snapshot is to be made (trio's clock)."""
        return self._at + self.period

    async def get(self, authorization: str | None) -> bytes:
        async with self._lock:
            if trio.current_time() >= self.due():
                snapshot = await self.source.snapshot("", DEFAULT_LIMIT, authorization)
                self._body = json.dumps(snapshot, separators=(",", ":")).encode()
                self._at = trio.current_time()
                self.made += 1
            return self._body


class _File:
    __slots__ = ("body", "etag", "kind")

    def __init__(self, body: bytes, kind: str) -> None:
        self.body = body
        self.kind = kind
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'


def _load_files() -> dict[str, _File]:
    files: dict[str, _File] = {}
    for entry in resources.files(__name__).joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = _File(entry.read_bytes(), _TYPES[suffix])
    return files


class Page:
    """The page's routes for a status app: :meth:`respond` answers the page's paths and
    returns None for any other."""

    def __init__(self, source: PageSource, *, period: float = PERIOD, max_watchers: int = MAX_WATCHERS) -> None:
        self.source = source
        self.max_watchers = max_watchers
        self.watchers = 0
        """Streams open now."""
        self.refused = 0
        """Streams refused (503) for :attr:`max_watchers`."""
        self.shared = _Shared(source, period)
        self._files = _load_files()

    def figures(self) -> dict[str, int]:
        """What the page costs: streams open and refused, snapshots made for them."""
        return {"watchers": self.watchers, "refused": self.refused, "snapshots": self.shared.made}

    async def respond(self, request: Request) -> Response | None:
        """The answer to ``request`` if its path is the page's, else None."""
        path = request.path
        if path in ("/", "/index.html"):
            return self._index(request)
        if path.startswith("/static/"):
            return self._static(request, path[len("/static/") :])
        if path == "/presence.json":
            return await self._json(request)
        if path == "/presence/stream":
            return self._stream(request)
        if path == "/presence/worker.json":
            return _json_response(self.source.worker())
        return None

    def _index(self, request: Request) -> Response:
        page = self._files["index.html"]
        prefix = request.header("x-forwarded-prefix") or ""
        base = prefix.rstrip("/") + "/" if _PREFIX.match(prefix) else ""
        # Without a prefix the page's relative URLs resolve against its own address,
        # which is right wherever it was opened with its trailing slash.
        body = page.body.replace(b"<!--base-->", f'<base href="{base}">'.encode() if base else b"")
        return Response(200, [("content-type", page.kind), ("cache-control", "no-cache")], body)

    def _static(self, request: Request, name: str) -> Response:
        found = self._files.get(name)
        if found is None or name == "index.html":
            return Response(404, [("content-type", "text/plain")], b"not found\n")
        headers = [("content-type", found.kind), ("etag", found.etag), ("cache-control", "max-age=3600")]
        if request.header("if-none-match") == found.etag:
            return Response(304, headers, b"")
        return Response(200, headers, found.body)

    async def _json(self, request: Request) -> Response:
        asked = parse_qs(request.query)
        query = asked.get("q", [""])[0]
        try:
            limit = int(asked.get("limit", [str(DEFAULT_LIMIT)])[0])
        except ValueError:
            return Response(400, [("content-type", "text/plain")], b"limit must be a whole number\n")
        if limit < 0:
            return Response(400, [("content-type", "text/plain")], b"limit must not be negative\n")
        snapshot = await self.source.snapshot(query, limit, request.header("authorization"))
        return _json_response(snapshot)

    def _stream(self, request: Request) -> Response:
        if self.watchers >= self.max_watchers:
            self.refused += 1
            return Response(
                503,
                [("content-type", "text/plain"), ("retry-after", "10")],
                b"too many live pages; poll presence.json\n",
            )
        return Response(
            200,
            [("content-type", "text/event-stream"), ("cache-control", "no-cache"), ("x-accel-buffering", "no")],
            self._events(request.header("authorization")),
        )

    async def _events(self, authorization: str | None) -> AsyncIterator[bytes]:
        self.watchers += 1
        try:
            # The browser waits this long before it opens a cut stream again.
            yield b"retry: 2000\n\n"
            while True:
                body = await self.shared.get(authorization)
                yield b"event: snapshot\ndata: " + body + b"\n\n"
                await trio.sleep_until(self.shared.due())
        finally:
            self.watchers -= 1


def _json_response(body: object) -> Response:
    return Response(
        200,
        [("content-type", "application/json"), ("cache-control", "no-cache")],
        json.dumps(body, separators=(",", ":")).encode() + b"\n",
    )
