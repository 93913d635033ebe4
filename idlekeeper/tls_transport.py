"""TLS on the dense engine: an :class:`ssl.SSLObject` driven from the engine's pass, no task.

A :class:`TLSTransport` is a :class:`~idlekeeper.Transport` whose bytes on the wire
are TLS records. The engine hands it what it reads; it feeds them to the
``SSLObject`` through a memory BIO, and what comes out (handshake messages,
records, alerts) goes to the kernel by the transport's own write path, with its
queue, gathering and backpressure. The protocol sees plaintext only: it writes
plaintext and is handed plaintext, as over TCP.

The rules are those of :mod:`idlekeeper.tls` (TLS on the streams path), so that a
server behaves the same on either engine:

- The handshake comes first, under an absolute deadline ``handshake_timeout``
  seconds from accept; no idle, receive or send timeout runs during it. The
  protocol is not made until it completes (``connection_made`` is its first
  callback, then as over TCP); a connection whose handshake fails is never shown to
  it, and is logged on one line with its reason and counted in
  :attr:`KeeperStats.handshake_failures <idlekeeper.KeeperStats.handshake_failures>`.
- When it completes, the listener's idle, receive and send timeouts start (counting
  from then) and the absolute deadline goes back to ``max_age``'s.
- Activity means application data: a record that has not come whole yet does not
  refresh a receive deadline, so a client trickling one byte of a record at a time
  is cut as a slowloris is over TCP.
- :meth:`~TLSTransport.close` sends ``close_notify`` before the queue's end; an
  expiry's last words (:meth:`idlekeeper.Protocol.last_words`) are sealed in a
  record, so a TLS peer reads them as any other.
- A protocol that pauses reading (or closes) in ``connection_made`` is handed
  nothing more until it resumes, though the client's first records came in the
  read that completed the handshake: they wait, already counted as activity, and
  come at the end of the pass in which it resumes, as they would come from the
  kernel over TCP.

Unlike a task per connection, nothing here waits: each step is the ``SSLObject``'s
synchronous work on bytes already read, so a handshake costs OpenSSL's work and a
few calls, not a task and its scheduling round trips.
"""

from __future__ import annotations

import contextlib
import logging
import math
import ssl
from typing import TYPE_CHECKING

from .stats import HandshakeFailure
from .transport import CLOSED, CLOSING, EOF_PENDING, EOF_SENT, PAUSED, PEER_EOF, Callbacks, Transport, peer_address

if TYPE_CHECKING:
    import socket as stdsocket

    from .stats import KeeperStats
    from .transport import _Loop
    from .watch import ExpireHook, _Owner

__all__ = ["TLSSettings", "TLSTransport", "check_handshake_timeout", "peer_address"]

logger = logging.getLogger("idlekeeper.tls")


def check_handshake_timeout(handshake_timeout: float) -> None:
    """Refuse a handshake timeout that is not a positive number of seconds."""
    if not handshake_timeout > 0:
        raise ValueError(f"handshake_timeout must be a positive number of seconds, not {handshake_timeout!r}")


class TLSSettings:
    """What a TLS listener of an engine gives each connection: its context, the
    handshake's deadline, and the timeouts that start when the handshake is done.
    One per listener, shared by its connections."""

    __slots__ = ("context", "handshake_timeout", "idle", "receive", "send", "stats")

    def __init__(
        self,
        context: ssl.SSLContext,
        handshake_timeout: float,
        idle: float | None,
        receive: float | None,
        send: float | None,
        stats: KeeperStats,
    ) -> None:
        check_handshake_timeout(handshake_timeout)
        self.context = context
        self.handshake_timeout = handshake_timeout
        self.idle = idle
        self.receive = receive
        self.send = send
        self.stats = stats


def handshake_failure(exc: BaseException) -> tuple[HandshakeFailure, str]:
    """Why a handshake broke (the peer went, or it spoke something else), and the
    error's words for the log line."""
    cause = exc.__cause__ or exc
    closed = isinstance(cause, ssl.SSLEOFError | ssl.SSLZeroReturnError) or not isinstance(cause, ssl.SSLError)
    why = str(cause) or type(cause).__name__
    return (HandshakeFailure.CLOSED if closed else HandshakeFailure.ERROR), why


class TLSTransport(Transport):
    """A dense engine's connection that speaks TLS; see :mod:`idlekeeper.tls_transport`.

    Made by the engine for a listener served with an ``ssl_context``. To its protocol
    it is a :class:`~idlekeeper.Transport` like any other. :meth:`get_extra_info`
    adds asyncio's TLS names: ``"ssl_object"``, ``"peercert"``, ``"cipher"``.
    """

    __slots__ = ("_ssl", "_incoming", "_outgoing", "_app", "_settings", "_until", "_held")

    _tls = True

    def __init__(
        self,
        owner: _Owner,
        loop: _Loop,
        sock: stdsocket.SocketType,
        settings: TLSSettings,
        *,
        stall_check: bool,
        on_expire: ExpireHook | None,
    ) -> None:
        super().__init__(owner, loop, sock, stall_check=stall_check, on_expire=on_expire)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = settings.context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._settings = settings
        self._app: Callbacks | None = None
        """The protocol, until the handshake completes and it is made."""
        self._until = math.inf
        """The absolute deadline the handshake's stands in for (``max_age``'s)."""
        self._held: tuple[list[bytes], bool] | None = None
        """Plaintext (and whether the peer's end followed it) opened while the protocol
        had paused reading: handed over when it resumes."""

    def _begin(self, protocol: Callbacks, max_age: float | None, now: float) -> None:
        """Start the handshake phase (called by the engine instead of ``connection_made``)."""
        self._app = protocol
        self._until = math.inf if max_age is None else now + max_age
        self._first_deadlines(None, None, None, now + self._settings.handshake_timeout, max_age, now)

    @property
    def ssl_object(self) -> ssl.SSLObject:
        """The connection's :class:`ssl.SSLObject` (its peer's certificate, its cipher)."""
        return self._ssl

    @property
    def handshake_done(self) -> bool:
        """Whether the handshake completed (and the protocol was made)."""
        return self._app is None

    # -- bytes from the engine -------------------------------------------------------

    def _tls_received(self, data: bytes, at: float | None) -> None:
        """What the engine read (``b""``: EOF); ``at`` is when the kernel received it,
        if the engine is coalescing."""
        if not data:
            self._tls_eof()
            return
        self._incoming.write(data)
        if self._app is not None and not self._handshake():
            return
        chunks: list[bytes] = []
        eof = False
        read = self._ssl.read
        size = self._loop.read_size
        try:
            while True:
                chunk = read(size)
                if not chunk:
                    eof = True
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            eof = True  # close_notify: the peer's clean end of the stream
        except ssl.SSLError as exc:
            self._loop._drop(self, exc)
            return
        self._send_records()  # a post-handshake message may want an answer (a key update)
        protocol = self._protocol
        if protocol is None:
            return
        if chunks:
            self._rx = self._owner._epochs.current if at is None else at
        held = self._held
        if held is not None:
            # Read in the pass that follows a resume, before its end hands the held
            # plaintext over: it goes first.
            self._held = None
            chunks, eof = held[0] + chunks, held[1] or eof
        if self._io & (PAUSED | CLOSING):
            # Paused or closed by connection_made, which this read's Finished ran (the
            # engine reads no paused transport): a plaintext transport would not have
            # read on, so this waits for resume_reading (and is dropped by a close), as
            # its bytes would wait in the kernel.
            if chunks or eof:
                self._held = (chunks, eof)
            return
        self._hand_over(protocol, chunks, eof)

    def _hand_over(self, protocol: Callbacks, chunks: list[bytes], eof: bool) -> None:
        try:
            if chunks:
                protocol.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            if eof and not self._io & (CLOSING | CLOSED):
                self._end_of_input(protocol)
        except Exception as exc:
            self._raised(protocol, exc)

    def resume_reading(self) -> None:
        """Read again after :meth:`pause_reading`; what was opened while paused comes
        first, at the end of the engine's pass (never inside this call)."""
        super().resume_reading()
        if self._held is not None:
            self._loop._resume_later(self)

    def _release_held(self) -> None:
        """Hand over what was opened while paused, unless paused again or closed meanwhile."""
        held, protocol = self._held, self._protocol
        if held is None or protocol is None or self._io & (PAUSED | CLOSING | CLOSED):
            return
        self._held = None
        self._hand_over(protocol, *held)

    def _tls_eof(self) -> None:
        """The peer closed its end of the TCP connection."""
        protocol = self._protocol
        if protocol is None:
            if self._app is not None:
                self._failed(HandshakeFailure.CLOSED, "EOF before the handshake completed")
            self._loop._drop(self, None)
            return
        held, self._held = self._held, None
        if held is not None:  # read after a resume, before the pass's end handed these over
            self._hand_over(protocol, held[0], True)
            return
        try:
            # Without close_notify, as https_compatible streams take it: the end of input.
            self._end_of_input(protocol)
        except Exception as exc:
            self._raised(protocol, exc)

    def _end_of_input(self, protocol: Callbacks) -> None:
        """The peer's end, with close_notify or without: as a TCP EOF is taken."""
        self._io |= PEER_EOF
        self._loop._update(self)
        if not protocol.eof_received() or self._io & EOF_SENT:
            self.close()

    def _raised(self, protocol: Callbacks, exc: Exception, callback: str = "protocol") -> None:
        """A callback raised: logged, counted, and this connection only is closed."""
        self._loop.callback_errors += 1
        logger.exception(
            "idlekeeper: %s %r raised on the connection from %s; closing it", callback, protocol, self._peer()
        )
        self._loop._drop(self, exc)

    def _handshake(self) -> bool:
        """Take the handshake a step; True once it is complete and the protocol made."""
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._send_records()
            return False
        except ssl.SSLError as exc:
            # Its alert goes out if the kernel takes it now; the close follows anyway.
            alert = self._outgoing.read()
            if alert:
                with contextlib.suppress(OSError):
                    self._socket.send(alert)
            failure, why = handshake_failure(exc)
            self._failed(failure, why)
            self._loop._drop(self, exc)
            return False
        self._send_records()
        settings = self._settings
        settings.stats.handshakes += 1
        protocol, self._app = self._app, None
        assert protocol is not None
        # The handshake's deadline gives way to max_age's, and the timeouts start now.
        self.deadline = None if self._until == math.inf else self._until
        if settings.idle is not None:
            self.idle_timeout = settings.idle
        if settings.receive is not None:
            self.receive_timeout = settings.receive
        if settings.send is not None:
            self.send_timeout = settings.send
        self._protocol = protocol
        try:
            protocol.connection_made(self)
        except Exception as exc:
            self._raised(protocol, exc, "connection_made of")
            return False
        return not self._io & CLOSED

    def _failed(self, failure: HandshakeFailure, why: str) -> None:
        self._settings.stats.handshake_failures[failure] += 1
        logger.info("idlekeeper: TLS handshake with %s failed (%s): %s", peer_address(self._socket), failure, why)

    # -- bytes to the peer -----------------------------------------------------------

    def _send_records(self) -> None:
        """Hand what the SSLObject wrote to the transport's write path."""
        records = self._outgoing.read()
        if records:
            Transport.write(self, records)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` sealed in TLS records; see :meth:`Transport.write`."""
        if self._io & (CLOSING | CLOSED | EOF_PENDING | EOF_SENT) or not data or self._app is not None:
            return
        try:
            self._ssl.write(data)
        except ssl.SSLError as exc:
            self._loop._drop(self, exc)
            return
        self._send_records()

    def _seal(self, data: bytes) -> bytes:
        try:
            self._ssl.write(data)
        except (ssl.SSLError, ValueError):
            return b""
        return self._outgoing.read()

    def _notify_close(self) -> None:
        """Queue ``close_notify``: the peer can tell our end from a cut connection."""
        if self._app is not None or self._io & (EOF_PENDING | EOF_SENT | CLOSING | CLOSED):
            return
        try:
            self._ssl.unwrap()
        except ssl.SSLError:
            pass  # want-read: ours is written; the peer's is not waited for
        except ValueError:
            return
        self._send_records()

    def write_eof(self) -> None:
        """Send ``close_notify`` and half-close: TLS has no other end of output."""
        self._notify_close()
        super().write_eof()

    def close(self) -> None:
        """Send ``close_notify``, then close once the queue is sent."""
        self._notify_close()
        super().close()

    # -- the keeper's side -------------------------------------------------------------

    def cancel(self) -> None:
        """Abort from outside, or at a deadline; an expiry before the handshake completed
        is the handshake's timeout, counted and logged as such."""
        if self._app is not None and self._expiry is not None and not self._io & CLOSED:
            self._failed(
                HandshakeFailure.TIMEOUT,
                f"not complete {self._settings.handshake_timeout}s after accept",
            )
        super().cancel()

    def get_extra_info(self, name: str, default: object = None) -> object:
        """:meth:`Transport.get_extra_info`, and ``"ssl_object"``, ``"peercert"`` (the
        verified certificate, decoded) and ``"cipher"`` once the handshake is done."""
        if name == "ssl_object":
            return self._ssl
        if name in ("peercert", "cipher"):
            try:
                got = self._ssl.getpeercert() if name == "peercert" else self._ssl.cipher()
            except ValueError:
                return default
            return default if got is None else got
        return super().get_extra_info(name, default)

    def __repr__(self) -> str:
        return "<TLS" + super().__repr__()[1:]
