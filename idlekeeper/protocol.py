"""The callbacks a dense engine calls: what a connection's code looks like without a task.

The shape is asyncio's ``Protocol``, which Python users know: the engine calls
:meth:`Protocol.connection_made` once, then :meth:`~Protocol.data_received` for each
read, :meth:`~Protocol.eof_received` when the peer half-closes, and
:meth:`~Protocol.connection_lost` exactly once at the end, with the reason (see
:mod:`idlekeeper.lost`). Every callback is synchronous and must be quick: it runs in
the engine's one task, between other connections' reads. Work that waits (a password
check, a database) goes to a task or a thread, with reading paused meanwhile if order
matters.

No trio, no I/O here: this module only names the callbacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the transport imports trio; a protocol module need not
    from .deadlines import Reason
    from .transport import Transport

__all__ = ["Protocol"]


class Protocol:
    """Base class for connection callbacks; override what you need.

    One instance per connection, made by the factory given to the engine. The
    defaults do nothing, except :meth:`eof_received`, which lets the engine close.
    Subclasses may declare ``__slots__``: a million connections without a dict each.
    """

    __slots__ = ()

    def connection_made(self, transport: Transport) -> None:
        """The connection is accepted and watched; keep ``transport`` to write and to
        set deadlines (it is an :class:`~idlekeeper.Watch`)."""

    def data_received(self, data: bytes) -> None:
        """Bytes arrived (activity is already stamped). Raising closes this connection
        only, and the error is logged."""

    def eof_received(self) -> bool | None:
        """The peer sent EOF (half-closed). Return true to keep writing (and close
        later yourself); otherwise the engine closes once what is queued is sent."""
        return None

    def pause_writing(self) -> None:
        """More than the high-water mark is queued for this peer; reading from it is
        paused too until the queue drains."""

    def resume_writing(self) -> None:
        """The queue drained below the low-water mark; reading resumed."""

    def last_words(self, reason: Reason) -> bytes | None:
        """A deadline expired (``reason``) and the connection is about to be closed: the
        bytes to send it first (a protocol's goodbye, MQTT 5's DISCONNECT 0x8D), or None.

        Called by the reaper, synchronously, just before the close. The bytes go to the
        kernel without waiting, and only if nothing else is queued (they must not cut
        into a message being sent); otherwise, or if the kernel takes only part of
        them, they are dropped. A best effort: a peer that has gone never reads them."""
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        """The connection is closed; called exactly once.

        ``exc`` is None after a close of ours or a clean EOF,
        :class:`~idlekeeper.ExpiredError` when a deadline ended it,
        :class:`~idlekeeper.EngineClosedError` when the engine stopped, or the ``OSError``
        that broke it (a reset, say).
        """
