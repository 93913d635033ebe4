"""One connection of a dense engine: its socket, its write queue and its deadlines.

A :class:`Transport` is a :class:`~idlekeeper.Watch`: the same keeper files it in
the same wheel and the reaper expires it by the same rules; the engine stamps its
activity as it reads and writes. It is also what the protocol writes to, as
asyncio's transports are: :meth:`~Transport.write` never blocks; what the kernel
does not take at once is queued and sent when the socket is writable, and a peer
whose queue passes the high-water mark stops being read until it drains
(backpressure: a client that does not read cannot make the server buffer for it
without limit).

Everything here is synchronous and runs in the engine's trio thread; the engine
owns the epoll set, this module only asks it for changes.
"""

from __future__ import annotations

import logging
import socket as stdsocket
from typing import TYPE_CHECKING, Protocol

from .deadlines import Reason
from .lost import ExpiredError
from .watch import Watch

if TYPE_CHECKING:
    from .watch import ExpireHook, _Owner

__all__ = ["Callbacks", "Transport", "peer_address"]


def peer_address(sock: object) -> str:
    """``host:port`` of a socket's peer, as the presence log writes it, for a log line;
    ``?`` once the kernel no longer knows it."""
    try:
        return _host_port(sock.getpeername())  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return "?"


def _host_port(address: object) -> str:
    """``host:port`` of a socket address (IPv4's pair, IPv6's four), ``?`` of anything else."""
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return "?"


logger = logging.getLogger("idlekeeper.engine")

# Bits of Transport._io. An open, idle connection's value (REG_IN, and CANNED) stays
# at most 256, one of the small ints CPython shares: a larger one would be an int
# object of every connection's own, 28 bytes each. States that pass take the high bits.
PAUSED = 1
"""The protocol asked not to be read."""
BACKPRESSURE = 2
"""Too much is queued for this peer: not read until it drains."""
PEER_EOF = 4
"""The peer half-closed; nothing more to read."""
EOF_PENDING = 8
"""``write_eof`` once the queue is sent."""
EOF_SENT = 16
CLOSING = 32
"""``close`` once the queue is sent."""
CANNED = 64
"""The engine may answer this connection's canned requests itself (see :attr:`Transport.canned_replies`)."""
REG_IN = 128
"""In the engine's epoll set for reading (the engine's bit)."""
CLOSED = 256
GATHERING = 512
"""Written to again during the engine's pass: the queue goes to the kernel in one send at its end."""
REG_OUT = 1024
"""In the engine's epoll set for writing (the engine's bit)."""
NO_READ = PAUSED | BACKPRESSURE | PEER_EOF | CLOSING | CLOSED

GATHER_LIMIT = 64 * 1024
"""Bytes a pass gathers for one connection before sending them there and then (fewer,
if the engine's high-water mark is lower)."""


class Callbacks(Protocol):
    """What a transport's protocol is told: the methods of :class:`idlekeeper.Protocol`,
    described here so that this module need not import that one (which names this one).
    ``last_words(reason)`` is asked for too, if the protocol has it (see there)."""

    def connection_made(self, transport: Transport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def eof_received(self) -> bool | None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def connection_lost(self, exc: BaseException | None) -> None: ...


class _Loop(Protocol):
    """What a transport needs from its engine (abstract, to keep imports one way)."""

    high_water: int
    low_water: int
    read_size: int
    callback_errors: int
    _in_pass: bool
    _polled: int
    _gathered: list[Transport]

    def _update(self, transport: Transport) -> None: ...

    def _drop(self, transport: Transport, exc: BaseException | None) -> None: ...

    def _accepted_peer(self, transport: Transport) -> object: ...

    def _resume_later(self, transport: Transport) -> None: ...


class Transport(Watch):
    """A connection served by a dense engine; the protocol's handle on it.

    Deadlines are the :class:`~idlekeeper.Watch` attributes (``idle_timeout``,
    ``receive_timeout``, ``send_timeout``, ``deadline``), set per phase as with a
    watched stream. Expiry closes the socket at once and the protocol hears
    :class:`~idlekeeper.ExpiredError` in ``connection_lost``.
    """

    __slots__ = ("_loop", "_protocol", "_wbuf", "_io")
    _tls = False
    """Whether the bytes on the wire are TLS records (a :class:`~idlekeeper.tls_transport.TLSTransport`)."""
    # The watch's own socket slot, always a socket here (a second slot holding the
    # same object would cost every connection 8 bytes).
    _socket: stdsocket.SocketType

    def __init__(
        self,
        owner: _Owner,
        loop: _Loop,
        sock: stdsocket.SocketType,
        *,
        stall_check: bool,
        on_expire: ExpireHook | None,
    ) -> None:
        super().__init__(owner, sock, close=True, stall_check=stall_check, on_expire=on_expire)
        self._loop = loop
        self._protocol: Callbacks | None = None
        # A bytearray, or while a pass gathers a single write, that write's bytes.
        self._wbuf: bytearray | bytes | None = None
        self._io = 0

    # -- writing -------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data``, queueing what the kernel does not take now. Never blocks.

        The first write a protocol callback (the engine's pass) makes to a connection
        goes to the kernel at once, as does any write from anywhere else (a task, a
        timer). What the pass writes to it after that is gathered and sent as the pass
        ends, in one system call: the rest of the replies to the packets of one read,
        and of what other connections' packets forwarded here. So a pass sends at most
        twice to a connection, and a lone reply (a heartbeat's) costs no gathering.
        :meth:`get_write_buffer_size` counts gathered bytes until they are sent.

        After :meth:`close`, :meth:`abort` or :meth:`write_eof`, writes are dropped.
        """
        if self._io & (CLOSING | CLOSED | EOF_PENDING | EOF_SENT) or not data:
            return
        if data.__class__ is memoryview:
            data = data.cast("B")  # counted in bytes, whatever its item size
        buf = self._wbuf
        if buf is None:
            loop = self._loop
            if (
                loop._in_pass
                and self._tx is self._owner._epochs.current
                and len(data) < GATHER_LIMIT
                and len(data) <= loop.high_water
            ):
                # Written to already in this pass: a send now would be one of many (a
                # publisher's PUBACKs, a subscriber's messages), so the rest are gathered
                # into one at its end. The first went at once: most passes write once to
                # a connection, and the peer can start on it while the pass goes on.
                # Bytes are kept as they are; a second gathered write makes a bytearray.
                self._wbuf = data if isinstance(data, bytes) else bytearray(data)
                self._io |= GATHERING
                self._tx = self._owner._epochs.current
                loop._gathered.append(self)
                return
            self._send_now(data)
            return
        if isinstance(buf, bytes):
            buf = self._wbuf = bytearray(buf)
        buf += data
        if self._io & GATHERING:
            # Past the limit, or the high-water mark (which must pause the writer
            # now, as an unsent write would): offered to the kernel there and then.
            if len(buf) >= GATHER_LIMIT or len(buf) > self._loop.high_water:
                self._send_gathered()
            return
        self._check_high_water(buf)

    def _send_now(self, data: bytes | bytearray | memoryview) -> None:
        """Offer ``data`` to the kernel now, with nothing queued or gathered before it;
        what it does not take is queued (the engine's canned replies come here too)."""
        # _offer's work, inline: this is the path of every heartbeat's reply.
        try:
            sent = self._socket.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._loop._drop(self, exc)
            return
        # Stamped even if the kernel took nothing: a send starts now, and its
        # timeout counts from here (as WatchedStream.send_all), not from the last
        # write the kernel took whole, which may be long ago.
        self._tx = self._owner._epochs.current
        if sent == len(data):
            return
        buf = self._wbuf = bytearray(memoryview(data)[sent:])
        self._sending = True
        self._loop._update(self)
        self._check_high_water(buf)

    def _offer(self, data: bytes | bytearray | memoryview) -> int:
        """Offer ``data`` to the kernel: the bytes it took (0: none now), or -1 if the
        connection failed (and is dropped)."""
        try:
            return self._socket.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self._loop._drop(self, exc)
            return -1

    def _check_high_water(self, buf: bytearray) -> None:
        if len(buf) > self._loop.high_water and not self._io & BACKPRESSURE:
            self._io |= BACKPRESSURE
            self._loop._update(self)
            self._call("pause_writing")

    def _send_gathered(self, *, closing: bool = False) -> None:
        """Send what this pass gathered (called by the engine as the pass ends, and
        before anything that must see the kernel's queue: a close, an EOF, a drop).
        What the kernel does not take is queued as an unsent write would have been;
        ``closing``: the connection is being dropped, and an error is its own."""
        io = self._io
        if not io & GATHERING:
            return
        self._io = io & ~GATHERING
        buf = self._wbuf
        if buf is None or io & CLOSED:
            return
        # _offer's work, inline: this runs for every connection a pass wrote to twice.
        try:
            sent = self._socket.send(buf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            if not closing:
                self._loop._drop(self, exc)
            return
        if closing:
            return
        if sent == len(buf):
            self._wbuf = None
            return
        if isinstance(buf, bytes):
            buf = self._wbuf = bytearray(buf)
        del buf[:sent]
        self._sending = True
        self._loop._update(self)
        self._check_high_water(buf)

    def _flush(self) -> None:
        """The socket is writable: send what is queued (called by the engine)."""
        buf = self._wbuf
        if buf is None:
            return
        sent = self._offer(buf)
        if sent <= 0:
            return  # nothing taken (progress is not stamped), or dropped
        self._tx = self._owner._epochs.current
        if isinstance(buf, bytes):  # pragma: no cover - a gathered write is not flushed so
            buf = self._wbuf = bytearray(buf)
        del buf[:sent]
        if buf:
            if self._io & BACKPRESSURE and len(buf) <= self._loop.low_water:
                self._relieve()
            return
        self._wbuf = None
        self._sending = False
        if self._io & BACKPRESSURE:
            self._relieve()
        if self._io & CLOSING:
            self._loop._drop(self, None)
            return
        if self._io & EOF_PENDING:
            self._shutdown_write()
        self._loop._update(self)

    def _relieve(self) -> None:
        self._io &= ~BACKPRESSURE
        self._loop._update(self)
        self._call("resume_writing")

    def get_write_buffer_size(self) -> int:
        """Bytes queued and not yet taken by the kernel (those :attr:`gathered` included)."""
        return 0 if self._wbuf is None else len(self._wbuf)

    @property
    def gathered(self) -> int:
        """Bytes written in the engine's current pass, to be offered to the kernel as
        it ends (see :meth:`write`): queued, but not because the peer is slow."""
        return len(self._wbuf) if self._io & GATHERING and self._wbuf is not None else 0

    def write_eof(self) -> None:
        """Half-close: send EOF once the queue is sent; reading goes on."""
        if self._io & (EOF_PENDING | EOF_SENT | CLOSED):
            return
        self._send_gathered()
        if self._io & CLOSED:
            return
        if self._wbuf is None:
            self._shutdown_write()
        else:
            self._io |= EOF_PENDING

    def _shutdown_write(self) -> None:
        self._io = (self._io & ~EOF_PENDING) | EOF_SENT
        try:
            self._socket.shutdown(stdsocket.SHUT_WR)
        except OSError as exc:
            self._loop._drop(self, exc)
            return
        if self._io & PEER_EOF:  # both directions are done
            self._loop._drop(self, None)

    # -- reading -------------------------------------------------------------------

    def pause_reading(self) -> None:
        """Stop reading from this peer (its bytes wait in the kernel, and spare it
        from inactivity expiry: they are the peer's activity)."""
        if not self._io & PAUSED:
            self._io |= PAUSED
            self._loop._update(self)

    def resume_reading(self) -> None:
        """Read again after :meth:`pause_reading`."""
        if self._io & PAUSED:
            self._io &= ~PAUSED
            self._loop._update(self)

    @property
    def alone_in_pass(self) -> bool:
        """Whether the engine's current pass serves this connection and no other.

        Then nothing else waits on the engine, and a protocol with a long reply to
        make may write it in pieces as it makes them: the peer starts on the first
        (which :meth:`write` offers to the kernel at once) while the rest is made,
        where a reply made whole would keep the peer waiting for all of it. In a busy
        pass the extra send would be taken from other connections, so this is False
        there, and outside a pass.
        """
        loop = self._loop
        return loop._in_pass and loop._polled == 1

    @property
    def reading(self) -> bool:
        """Whether the engine reads this connection now."""
        return not self._io & NO_READ

    @property
    def canned_replies(self) -> bool:
        """Whether the engine may answer this connection's canned requests itself.

        While True, a read whose bytes are exactly a request registered with
        :meth:`Engine.add_canned_reply <idlekeeper.Engine.add_canned_reply>` is
        answered with its reply, written as :meth:`write` would, and the protocol's
        ``data_received`` is not called; the read is activity all the same. A
        protocol sets it only while the request, arriving alone, could mean nothing
        else (an MQTT PINGREQ on a connected session with no packet half-read), and
        clears it otherwise. A request split over reads or sent with other bytes
        still reaches the protocol, which must answer it as before. False at first;
        plaintext connections only (a TLS transport's reads are records).
        """
        return bool(self._io & CANNED)

    @canned_replies.setter
    def canned_replies(self, allowed: bool) -> None:
        if allowed:
            self._io |= CANNED
        else:
            self._io &= ~CANNED

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Close once the queue is sent (reading stops now). ``connection_lost(None)``
        follows. A queue that never drains is cut by the send timeout, if one is set."""
        if self._io & (CLOSING | CLOSED):
            return
        self._send_gathered()
        if self._io & CLOSED:
            return
        self._io |= CLOSING
        if self._wbuf is None:
            self._loop._drop(self, None)
        else:
            self._loop._update(self)

    def abort(self) -> None:
        """Close now, dropping anything queued; ``connection_lost(None)`` follows.
        What this pass gathered is offered to the kernel first, as it would have been
        without gathering."""
        self._loop._drop(self, None)

    def is_closing(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` was called, or the connection is gone."""
        return bool(self._io & (CLOSING | CLOSED))

    @property
    def protocol(self) -> Callbacks | None:
        """The connection's protocol (None once it has been told the connection is lost)."""
        return self._protocol

    def get_extra_info(self, name: str, default: object = None) -> object:
        """asyncio's names: ``"socket"``, ``"peername"``, ``"sockname"``.

        In ``connection_made``, ``"peername"`` of a peer that already reset (the kernel
        no longer knows its address) is the address ``accept`` returned.
        """
        try:
            if name == "socket":
                return self._socket
            if name == "peername":
                return self._socket.getpeername()
            if name == "sockname":
                return self._socket.getsockname()
        except OSError:
            if name == "peername":
                # Reset before it was read: in connection_made, accept's address stands in.
                peer = self._loop._accepted_peer(self)
                return default if peer is None else peer
            return default
        return default

    def _peer(self) -> str:
        """The peer's ``host:port`` for a log line about this connection: read only
        when one is written, as a kept address would cost every connection its bytes."""
        return _host_port(self.get_extra_info("peername"))

    # -- the keeper's side: expiry and outside cancellation ------------------------

    def cancel(self) -> None:
        """Abort the connection from outside (a takeover, a shutdown); the protocol
        hears ``connection_lost(None)``, or :class:`ExpiredError` after an expiry."""
        reason = self.reason
        self._send_gathered()
        if reason is not None and self._wbuf is None and not self._io & (CLOSING | CLOSED):
            self._say_last_words(reason)
        self._loop._drop(self, None if reason is None else ExpiredError(reason))

    def _say_last_words(self, reason: Reason) -> None:
        protocol = self._protocol
        words = getattr(protocol, "last_words", None)  # optional: a Callbacks need not have it
        if words is None:
            return
        try:
            data = words(reason)
            if data:
                self._socket.send(self._seal(data))
        except OSError:
            pass  # gone, or its buffer full: the close follows anyway
        except Exception:
            self._loop.callback_errors += 1
            logger.exception("idlekeeper: last_words of %r raised on the connection from %s", protocol, self._peer())

    def _seal(self, data: bytes) -> bytes:
        """``data`` as it goes on the wire (TLS seals it in a record)."""
        return data

    def _call(self, name: str) -> None:
        protocol = self._protocol
        if protocol is None:
            return
        try:
            getattr(protocol, name)()
        except Exception as exc:
            self._loop.callback_errors += 1
            logger.exception(
                "idlekeeper: %s of %r raised on the connection from %s; closing it", name, protocol, self._peer()
            )
            self._loop._drop(self, exc)

    def __repr__(self) -> str:
        state = "closed" if self._io & CLOSED else ("closing" if self._io & CLOSING else "open")
        reason = "" if self.reason is None else f" expired ({Reason(self.reason).value})"
        return f"<Transport fd={self._socket.fileno()} {state}{reason} queued={self.get_write_buffer_size()}>"
