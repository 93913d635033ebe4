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
"""

from __future__ import annotations

import math
import subprocess
import sys

from ..processes import start_http, wait_listening

__all__ = ["ALL_HTTP_TARGETS", "ASGI_APP", "HTTP_TARGETS", "start_http_target"]

HTTP_TARGETS = ("idlekeeper", "idlekeeper-native", "hypercorn", "uvicorn")
"""What ``compare`` runs by default."""
ALL_HTTP_TARGETS = (*HTTP_TARGETS, "idlekeeper-streams")

ASGI_APP = "loadtest.asgi_app:app"


def start_http_target(
    name: str, port: int, *, header_timeout: float, keep_alive: float, tick: float = 0.1
) -> subprocess.Popen[str]:
    """Start ``name`` on ``127.0.0.1:port``; return once it accepts connections. Stop it by PID."""
    if name.startswith("idlekeeper"):
        if name not in ALL_HTTP_TARGETS:
            raise ValueError(f"unknown HTTP target {name!r}")
        extra = [] if name == "idlekeeper-native" else [ASGI_APP]
        extra += ["--engine", "streams" if name == "idlekeeper-streams" else "dense"]
        extra += ["--tick", str(tick), "--header-timeout", str(header_timeout)]
        extra += ["--keep-alive-timeout", str(keep_alive), "--send-timeout", str(header_timeout)]
        return start_http(port, 1, extra)
    if name == "hypercorn":
        cmd = [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--workers", "1"]
        cmd += ["--bind", f"127.0.0.1:{port}", "--keep-alive", str(math.ceil(keep_alive)), "loadtest.asgi_app:app"]
    elif name == "uvicorn":
        cmd = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--timeout-keep-alive", str(math.ceil(keep_alive)), "--log-level", "warning", "--no-access-log"]
        cmd += ["loadtest.asgi_app:app"]
    else:
        raise ValueError(f"unknown HTTP target {name!r}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    wait_listening(port, proc)
    return proc
