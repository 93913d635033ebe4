"""The one line a worker writes when it is serving, and the one reader of it.

Whoever starts a server process (the load tester, the tests, an operator's script)
waits for each worker's line on stderr before sending traffic. Writer and reader
live together here so that the format is a contract in one place, not an f-string
in each server and a regex in each reader.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["Ready", "announce", "announce_ready", "find_ready", "netloc"]

# Hosts are written as in a URL (IPv6 in brackets), so a port ends where its digits
# do, even when another worker's line follows with no newline between.
_HOST = r"\[[^\]\s]*\]|[^\s:\[\]]+"
_LINE = re.compile(
    rf"(?P<server>[a-z][\w.-]*?) worker (?P<worker>\d+): listening on (?P<host>{_HOST}):(?P<port>\d+)"
    rf"(?:, status on (?P<status_host>{_HOST}):(?P<status_port>\d+))?"
)


def netloc(host: str, port: int) -> str:
    """``host:port`` as in a URL (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host(text: str) -> str:
    return text[1:-1] if text.startswith("[") else text


@dataclass(frozen=True)
class Ready:
    """One worker that is serving: what it is, and where."""

    server: str
    """The server's short name: ``heartbeat``, ``http``, ``baseline``..."""
    worker: int
    host: str
    port: int
    status_host: str | None = None
    status_port: int | None = None

    def line(self) -> str:
        """The announcement, as written to stderr (without the newline)."""
        text = f"{self.server} worker {self.worker}: listening on {netloc(self.host, self.port)}"
        if self.status_port is not None:
            text += f", status on {netloc(self.status_host or self.host, self.status_port)}"
        return text


def announce(line: str) -> None:
    """Write one line to stderr in a single ``write()``.

    Workers share their supervisor's stderr; ``print`` may write the text and its
    newline separately, and lines from several processes then run together. One
    write of under 4 KiB to a pipe is atomic.
    """
    os.write(2, (line + "\n").encode())


def announce_ready(ready: Ready) -> None:
    """Tell whoever started this worker that it is serving."""
    announce(ready.line())


def find_ready(text: str, server: str | None = None) -> list[Ready]:
    """Every announcement in ``text`` (of ``server`` only, if given).

    Finds them anywhere in the text, so lines that ran together still count.
    """
    found = []
    for m in _LINE.finditer(text):
        if server is not None and m["server"] != server:
            continue
        status_port = m["status_port"]
        status_host = m["status_host"]
        found.append(
            Ready(
                server=m["server"],
                worker=int(m["worker"]),
                host=_host(m["host"]),
                port=int(m["port"]),
                status_host=_host(status_host) if status_host is not None else None,
                status_port=int(status_port) if status_port is not None else None,
            )
        )
    return found
