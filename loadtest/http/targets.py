"""The HTTP servers ``python -m loadtest http`` and ``compare`` measure, each one process.

What each enforces against a slow client, given ``header_timeout`` and ``keep_alive``:

All of them serve the same ASGI app, :mod:`loadtest.asgi_app`, except
``idlekeeper-native``: ``servers.http``'s built-in app on its native ``Request ->
Response`` interface, answering ``/`` with the same bytes (its own row, to show what
ASGI costs). ``idlekeeper-streams`` is the ASGI app on the task-per-connection driver.

- ``idlekeeper`` (``servers.http``, dense engine): ``--header-timeout`` for the whole request head
  from its first byte (trickled bytes do not extend it; 408), ``--keep-alive-timeout``
  between requests, ``--send-timeout`` (set to the header timeout here) between two
  writes that made progress.
- ``hypercorn`` (``--worker-class trio``): ``--keep-alive`` runs until the head is
  parsed; ``--read-timeout`` is off by default and left off, as shipped. No send timeout.
- ``uvicorn`` (h11 on asyncio): ``--timeout-keep-alive`` is cancelled on the first
  byte and never re-armed (its issue #157); no header or send timeout.
- ``uvicorn-standard``: the same uvicorn as ``pip install uvicorn[standard]`` runs it
  (httptools, uvloop, and the ``websockets`` library for WebSockets), as FastAPI's docs
  tell users to install it. Both uvicorn rows name their implementations on the command
  line: with the extra installed, plain ``uvicorn`` would otherwise pick them too.
- ``granian`` (``--interface asgi``, Rust's hyper under a Python ASGI bridge, on uvloop
  where it is installed): ``--http1-header-read-timeout`` set to the header timeout
  (milliseconds, at most 60 s); no keep-alive or send timeout on its command line.

``uvicorn-standard`` and ``granian`` are the servers users pick for speed: the HTTP
peers issue 30's targets are set against. Each is one worker process, as every row is.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Sequence

from ..mqtt_targets import PeerUnavailable
from ..processes import start_http, wait_listening

__all__ = [
    "ALL_HTTP_TARGETS",
    "ASGI_APP",
    "BENCH_MODULES",
    "HTTP_TARGETS",
    "UVICORN_IMPLEMENTATIONS",
    "bench_missing",
    "start_http_target",
]

HTTP_TARGETS = ("idlekeeper", "idlekeeper-native", "uvicorn-standard", "granian", "hypercorn", "uvicorn")
"""What ``compare`` runs by default."""
ALL_HTTP_TARGETS = (*HTTP_TARGETS, "idlekeeper-streams")

ASGI_APP = "loadtest.asgi_app:app"


UVICORN_IMPLEMENTATIONS = {
    "uvicorn": ("--http", "h11", "--loop", "asyncio"),
    "uvicorn-standard": ("--http", "httptools", "--loop", "uvloop", "--ws", "websockets"),
}
"""What each uvicorn row runs on."""

BENCH_MODULES = {
    "hypercorn": ("hypercorn",),
    "uvicorn": ("uvicorn",),
    "uvicorn-standard": ("uvicorn", "httptools", "uvloop", "websockets"),
    "granian": ("granian",),
}
"""The modules each peer runs on, all from the 'bench' extra (ours need none of them)."""


def bench_missing(name: str) -> str | None:
    """Why peer ``name`` cannot start here, in one line naming the 'bench' extra; None if it can."""
    absent = [module for module in BENCH_MODULES.get(name, ()) if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return f"needs the 'bench' extra (missing: {', '.join(absent)}): pip install 'idlekeeper[bench]'"


def start_http_target(
    name: str,
    port: int,
    *,
    header_timeout: float,
    keep_alive: float,
    tick: float = 0.1,
    extra: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """Start ``name`` on ``127.0.0.1:port``; return once it accepts connections. Stop it by PID.
    A peer whose modules are not installed raises :class:`PeerUnavailable` (:func:`bench_missing`).

    ``extra`` goes on the server's command line as it is (each server spells its own flags).
    """
    if name.startswith("idlekeeper"):
        if name not in ALL_HTTP_TARGETS:
            raise ValueError(f"unknown HTTP target {name!r}")
        args = [] if name == "idlekeeper-native" else [ASGI_APP]
        args += ["--engine", "streams" if name == "idlekeeper-streams" else "dense"]
        args += ["--tick", str(tick), "--header-timeout", str(header_timeout)]
        args += ["--keep-alive-timeout", str(keep_alive), "--send-timeout", str(header_timeout), *extra]
        return start_http(port, 1, args)
    # Checked first: a peer that is not installed would otherwise show only as a process
    # that exited before listening, with no word of what to install.
    why = bench_missing(name)
    if why is not None:
        raise PeerUnavailable(why)
    if name == "hypercorn":
        cmd = [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--workers", "1"]
        cmd += ["--bind", f"127.0.0.1:{port}", "--keep-alive", str(math.ceil(keep_alive)), "loadtest.asgi_app:app"]
    elif name in UVICORN_IMPLEMENTATIONS:
        cmd = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port)]
        cmd += UVICORN_IMPLEMENTATIONS[name]
        cmd += ["--timeout-keep-alive", str(math.ceil(keep_alive)), "--log-level", "warning", "--no-access-log"]
        cmd += ["loadtest.asgi_app:app"]
    elif name == "granian":
        header_ms = max(1, min(60_000, round(header_timeout * 1000)))  # the range granian takes
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--workers", "1", "--http", "1", "--http1-header-read-timeout", str(header_ms)]
        cmd += ["--log-level", "warning", ASGI_APP]
    else:
        raise ValueError(f"unknown HTTP target {name!r}")
    cmd += extra
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    wait_listening(port, proc)
    return proc
