"""A message bus between worker processes, through their supervisor.

Workers on one SO_REUSEPORT port each hold a share of the connections, but a
subscriber on one worker must hear about devices on all of them, and a device that
reconnects to another worker must take over its old connection there. Each worker
keeps one Unix-socket connection to the supervisor's :class:`Hub` and sends it JSON
lines; the hub relays every line to every other worker. Lines whose ``"t"`` is
``"s"`` (a worker's subscription filters) are also remembered per worker and
replayed to a worker that (re)connects, so a restarted worker knows at once where
to forward.

The hub is plain blocking Python (``selectors``), polled by the supervisor's loop;
:class:`BusClient` is the worker's trio side.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["BusClient", "Hub"]

_MAX_BUFFER = 64 * 1024 * 1024  # a worker this far behind is dropped, not waited for


class Hub:
    """The supervisor's end: accepts workers and relays their lines to each other."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ik-bus-")
        self.path = os.path.join(self._dir, "bus.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, bytearray] = {}
        self._out: dict[socket.socket, bytearray] = {}
        self._state: dict[str, bytes] = {}  # last "s" line per worker

    def poll(self, timeout: float) -> None:
        """Move whatever is ready, waiting at most ``timeout`` seconds."""
        for key, events in self._sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._listener:
                self._accept()
                continue
            if events & selectors.EVENT_READ:
                self._read(sock)
            if events & selectors.EVENT_WRITE and sock in self._out:
                self._flush(sock)

    def _accept(self) -> None:
        try:
            peer, _ = self._listener.accept()
        except BlockingIOError:
            return
        peer.setblocking(False)
        self._peers[peer] = bytearray()
        self._out[peer] = bytearray(b"".join(self._state.values()))
        self._sel.register(peer, selectors.EVENT_READ, None)
        self._want_write(peer)

    def _want_write(self, sock: socket.socket) -> None:
        # Ask for writability only while there is something to write, or select spins.
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._out.get(sock) else 0)
        self._sel.modify(sock, events, None)

    def _drop(self, sock: socket.socket) -> None:
        self._sel.unregister(sock)
        self._peers.pop(sock, None)
        self._out.pop(sock, None)
        sock.close()

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        buf = self._peers[sock]
        buf += data
        end = buf.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(buf[: end + 1])
        del buf[: end + 1]
        for line in lines.splitlines(keepends=True):
            if line.startswith(b'{"t":"s"'):
                worker = str(json.loads(line).get("w"))
                self._state[worker] = line
        for other in list(self._out):
            if other is not sock:
                out = self._out[other]
                out += lines
                if len(out) > _MAX_BUFFER:
                    self._drop(other)
                else:
                    self._want_write(other)

    def _flush(self, sock: socket.socket) -> None:
        out = self._out[sock]
        if not out:
            return
        try:
            sent = sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sock)
            return
        del out[:sent]
        if not out:
            self._want_write(sock)

    def close(self) -> None:
        """Close every connection and remove the socket file."""
        for sock in list(self._peers):
            self._drop(sock)
        self._sel.close()
        self._listener.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


class BusClient:
    """A worker's end: ``send`` never blocks; ``run`` connects and relays until cancelled."""

    def __init__(self, path: str, on_message: Callable[[dict[str, Any]], None]) -> None:
        self.path = path
        self._on_message = on_message
        self._outbox: list[bytes] = []
        self._wake = trio.Event()
        self.received = 0
        self.sent = 0

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message for the other workers."""
        self._outbox.append(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        self._wake.set()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the hub and move messages both ways until cancelled."""
        stream = await trio.open_unix_socket(self.path)
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, stream)
            task_status.started()
            buf = b""
            async for data in stream:
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line:
                        self.received += 1
                        self._on_message(json.loads(line))
            nursery.cancel_scope.cancel()

    async def _writer(self, stream: trio.SocketStream) -> None:
        while True:
            if not self._outbox:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            batch, self._outbox = self._outbox, []
            self.sent += len(batch)
            await stream.send_all(b"".join(batch))
