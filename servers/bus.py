"""Unix-socket links between a supervisor and its worker processes.

The supervisor is plain blocking Python, so its end, :class:`Hub`, is a
``selectors`` loop that the supervisor polls between its other chores. Each
worker holds one connection (a :class:`Link`) and exchanges newline-terminated
lines; what the lines mean is the business of the hub's :class:`LinkHandler` (the
heartbeat server's authority, say). The kernel tells the hub which process is at
the other end of each link (``SO_PEERCRED``), so a link cannot claim to be
another worker.

A worker that stops reading (stalled, SIGSTOPped) is not waited for: once
``max_buffer`` bytes are queued for it, its link is dropped and the handler told
so; the worker reconnects when it runs again and resynchronises.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import tempfile
from typing import Protocol

__all__ = ["Hub", "Link", "LinkHandler"]

DEFAULT_MAX_BUFFER = 64 * 1024 * 1024


class Link:
    """One worker's connection to the hub."""

    def __init__(self, hub: Hub, sock: socket.socket, number: int, pid: int) -> None:
        self._hub = hub
        self.sock = sock
        self.number = number
        self.pid = pid
        """The process at the other end, as the kernel reports it."""
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.open = True
        self.writable_wanted = False

    def send(self, data: bytes) -> None:
        """Queue ``data``; it is written as the peer reads."""
        self._hub._send(self, data)

    def __repr__(self) -> str:
        return f"<Link {self.number} pid={self.pid}>"


class LinkHandler(Protocol):
    """What the hub tells about its links."""

    def connected(self, link: Link) -> None:
        """A worker connected."""
        ...

    def received(self, link: Link, line: bytes) -> None:
        """A whole line (without its newline) came from ``link``."""
        ...

    def disconnected(self, link: Link, overflowed: bool) -> None:
        """``link`` is gone: closed by its worker, or dropped for not reading (``overflowed``)."""
        ...

    def batch_done(self, link: Link) -> None:
        """Everything ``link`` sent in one read has been handed to :meth:`received`."""
        ...

    # Optional: round_done() after each poll (see Hub.poll), wake_in() -> seconds until
    # it is due again (None: never), stop() when the supervisor stops the workers, and
    # close() when the hub closes.

    def process_exited(self, pid: int, code: int | None) -> object:
        """A worker process is gone, and everything its links held has been received."""
        ...


def _peer_pid(sock: socket.socket) -> int:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    except (AttributeError, OSError):  # not Linux: the handler must rely on what the worker says
        return 0


class Hub:
    """The supervisor's end: accepts workers' links and moves lines for its handler."""

    def __init__(self, handler: LinkHandler, *, max_buffer: int = DEFAULT_MAX_BUFFER) -> None:
        self.handler = handler
        self.max_buffer = max_buffer
        self._dir = tempfile.mkdtemp(prefix="ik-bus-")
        self.path = os.path.join(self._dir, "bus.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._links: dict[socket.socket, Link] = {}
        self._count = 0
        # While a link's batch of lines is handled, what the handler sends is gathered
        # per link and written as the batch ends: a batch's answers (a refill for a
        # client, then the acknowledgement of its reports) go out in one send, not one
        # each, and the worker is woken once.
        self._gathering = False
        self._gathered: dict[Link, None] = {}

    @property
    def links(self) -> list[Link]:
        """The open links."""
        return list(self._links.values())

    def fileno(self) -> int:
        """A descriptor that is readable while :meth:`poll` has something to do (the
        hub's epoll set), for a caller that waits on other things too."""
        return self._sel.fileno()

    def poll(self, timeout: float) -> None:
        """Move whatever is ready, waiting at most ``timeout`` seconds."""
        for key, events in self._sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._listener:
                self._accept()
                continue
            link = self._links.get(sock)
            if link is None:
                continue
            if events & selectors.EVENT_READ:
                self._read(link)
            if events & selectors.EVENT_WRITE and link.open:
                self._flush(link)
        self.tick()

    def tick(self) -> None:
        """Tell the handler a round of moving lines is done (its ``round_done``, if it
        has one: the heartbeat's authority commits its durable store there)."""
        round_done = getattr(self.handler, "round_done", None)
        if round_done is not None:
            round_done()

    def wake_in(self) -> float | None:
        """Seconds until the handler wants :meth:`tick` again without any line (None: never)."""
        wake_in = getattr(self.handler, "wake_in", None)
        return None if wake_in is None else wake_in()

    def stopping(self) -> None:
        """The supervisor is stopping its workers (tells the handler's ``stop``, if any)."""
        stop = getattr(self.handler, "stop", None)
        if stop is not None:
            stop()

    def process_exited(self, pid: int, code: int | None = None) -> None:
        """Read what a dead process's links still hold, close them, and tell the handler.

        A worker killed mid-stream leaves its last lines in the socket; they are
        applied before anyone declares its sessions lost, or a session it had
        already ended would be ended twice.
        """
        for link in [lk for lk in self._links.values() if lk.pid == pid]:
            link.sock.setblocking(True)
            link.sock.settimeout(0.5)
            while link.open:
                self._read(link)
        self.handler.process_exited(pid, code)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        self._count += 1
        link = Link(self, sock, self._count, _peer_pid(sock))
        sock.setblocking(False)
        self._links[sock] = link
        self._sel.register(sock, selectors.EVENT_READ, None)
        self.handler.connected(link)

    def _send(self, link: Link, data: bytes) -> None:
        if not link.open:
            return
        was_empty = not link.outbox
        link.outbox += data
        if len(link.outbox) > self.max_buffer:
            self._drop(link, overflowed=True)
        elif self._gathering:
            if was_empty:
                self._gathered[link] = None
        elif was_empty:
            # Most writes go straight out. A failure here is left for poll() to find:
            # dropping now would call the handler back from inside its own send.
            self._flush(link, drop_on_error=False)

    def _want_write(self, link: Link) -> None:
        # Ask for writability only while there is something to write, or select spins;
        # and change the registration only when that changes (a syscall per send otherwise).
        wanted = bool(link.outbox)
        if wanted != link.writable_wanted:
            link.writable_wanted = wanted
            self._sel.modify(link.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if wanted else 0), None)

    def drop(self, link: Link, overflowed: bool = False) -> None:
        """Close ``link`` and tell the handler (``overflowed``: for not reading)."""
        self._drop(link, overflowed)

    def _drop(self, link: Link, overflowed: bool = False) -> None:
        if not link.open:
            return
        link.open = False
        self._sel.unregister(link.sock)
        del self._links[link.sock]
        link.sock.close()
        self.handler.disconnected(link, overflowed)

    def _read(self, link: Link) -> None:
        try:
            data = link.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError, TimeoutError):
            if link.sock.getblocking() or link.sock.gettimeout() is not None:
                self._drop(link)  # process_exited: nothing more will come
            return
        except OSError:
            data = b""
        if not data:
            self._drop(link)
            return
        buf = link.inbox
        buf += data
        end = buf.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(buf[:end])
        del buf[: end + 1]
        self._gathering = True
        try:
            for line in lines.split(b"\n"):
                if line and link.open:
                    self.handler.received(link, line)
            if link.open:
                self.handler.batch_done(link)
        finally:
            self._gathering = False
            self._flush_gathered()

    def _flush_gathered(self) -> None:
        """Write what a batch's handling sent; a failure is left for poll() to find,
        as for a send made outside a batch."""
        gathered, self._gathered = self._gathered, {}
        for link in gathered:
            if link.open:
                self._flush(link, drop_on_error=False)

    def _flush(self, link: Link, drop_on_error: bool = True) -> None:
        if not link.outbox:
            return
        try:
            sent = link.sock.send(link.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            if drop_on_error:
                self._drop(link)
            else:
                self._want_write(link)
            return
        del link.outbox[:sent]
        if link.open:
            self._want_write(link)

    def close(self) -> None:
        """Close every link, remove the socket file, and tell the handler (its ``close``, if any)."""
        for link in list(self._links.values()):
            self._drop(link)
        close = getattr(self.handler, "close", None)
        if close is not None:
            close()
        self._sel.close()
        self._listener.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass
