"""A line-echo server that embeds the keeper: the smallest real server built on it.

    python -m servers.echo --port 7000 --idle 3 --line-timeout 5 --send-timeout 3

Each connection is watched with three deadlines that change with the phase:

- **idle**: nothing received or sent for ``--idle`` seconds;
- **line**: an absolute deadline from the first byte of a line to its newline, so
  a client trickling one byte a second (slowloris) cannot extend it;
- **send**: a pending reply makes no progress for ``--send-timeout`` (the client
  stopped reading).

Commands: ``PING`` answers ``PONG``; ``BLOB n`` sends n bytes; anything else is
echoed. Every connection's end is printed as one JSON line on stdout; SIGTERM or
SIGINT prints the keeper's statistics and exits. It is the server the demo drives.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import trio

import idlekeeper

from .listeners import port_of
from .settings import CommandLine, Host, Setting, port, seconds

MAX_LINE = 64 * 1024


class LineTooLong(Exception):
    """A line exceeded the maximum length."""


class LineBuffer:
    """Sans-IO line splitter: feed bytes, get complete lines."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._max = max_line

    @property
    def partial(self) -> bool:
        """Whether part of a line is waiting for its newline."""
        return bool(self._buf)

    def feed(self, data: bytes | bytearray) -> Iterator[bytes]:
        """Add received bytes; yield every line they complete (without the newline)."""
        self._buf += data
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buf[:end]).rstrip(b"\r")
            del self._buf[: end + 1]
            yield line
        if len(self._buf) > self._max:
            raise LineTooLong(f"line longer than {self._max} bytes")


def emit(event: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: the demo and tests read these."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the echo server until cancelled."""
    async with idlekeeper.open_keeper(tick=args.tick) as keeper:

        async def handle(stream: idlekeeper.WatchedStream) -> None:
            watch = stream.watch
            peer = stream.transport_stream.socket.getpeername()  # type: ignore[attr-defined]
            lines = LineBuffer()
            started = trio.current_time()
            try:
                async for data in stream:
                    if not lines.partial:
                        # A new line begins: it must be complete by this absolute time.
                        watch.deadline = trio.current_time() + args.line_timeout
                    for line in lines.feed(data):
                        await respond(stream, line)
                    if not lines.partial:
                        watch.deadline = None
            except LineTooLong as exc:
                await stream.send_all(f"ERR {exc}\n".encode())
                emit({"event": "closed", "peer": list(peer), "reason": "line-too-long"})
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                if watch.expired:
                    emit(
                        {
                            "event": "expired",
                            "peer": list(peer),
                            "reason": str(watch.reason),
                            "lag_ms": round(watch.lag * 1000, 3),
                            "age_s": round(trio.current_time() - started, 3),
                            "t": time.time(),
                        }
                    )
            emit({"event": "closed", "peer": list(peer), "reason": "eof"})

        listeners = await trio.open_tcp_listeners(args.port, host=args.host)
        port = port_of(listeners)
        emit({"event": "listening", "host": args.host, "port": port})
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: idlekeeper.serve_listeners(
                    handle,
                    listeners,
                    keeper=keeper,
                    idle=args.idle,
                    send=args.send_timeout,
                    task_status=task_status,
                )
            )
            task_status.started(port)
            try:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        break
            finally:
                emit({"event": "stats", "stats": keeper.stats.as_dict()})
                nursery.cancel_scope.cancel()


_CHUNK = b"B" * 65536


async def respond(stream: trio.abc.SendStream, line: bytes) -> None:
    """Answer one command line. A BLOB is streamed in pieces, so that a client that
    never reads costs the server one piece of memory, not the whole reply."""
    if line == b"PING":
        await stream.send_all(b"PONG\n")
    elif line.startswith(b"BLOB "):
        try:
            remaining = min(int(line[5:]), 1 << 30)
        except ValueError:
            await stream.send_all(b"ERR BLOB takes a byte count\n")
            return
        while remaining > 0:
            piece = _CHUNK if remaining >= len(_CHUNK) else _CHUNK[:remaining]
            await stream.send_all(piece)
            remaining -= len(piece)
    else:
        await stream.send_all(line + b"\n")


SETTINGS = (
    Setting("--host", Host(), "127.0.0.1", "address to listen on (default: 127.0.0.1)"),
    Setting("--port", port(), 7000, "TCP port; 0 picks a free one (default: 7000)"),
    Setting("--idle", seconds(), 3.0, "idle timeout in seconds (default: 3)"),
    Setting("--line-timeout", seconds(), 5.0, "a line must be complete this long after its first byte (default: 5)"),
    Setting("--send-timeout", seconds(), 3.0, "a reply may stall this long (default: 3)"),
    Setting("--tick", seconds(), 0.05, "keeper tick in seconds (default: 0.05)"),
)
"""The echo server's options (:mod:`servers.settings`)."""


def parser() -> CommandLine:
    """The command line."""
    return CommandLine(SETTINGS, prog="python -m servers.echo", description=(__doc__ or "").split("\n\n")[0])


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    trio.run(serve, parser().parse_args(argv))


if __name__ == "__main__":
    main()
