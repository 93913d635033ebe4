"""One side of a bridge: a :class:`~..mqtt.client.ClientSession` and the network
connection it currently has (:class:`Side`), and how the remote side's connection is
opened, over TCP or TLS with the bridge's files (:func:`open_remote`)."""

from __future__ import annotations

import contextlib
import ssl

import trio

import idlekeeper

from ..bridge import BridgeAddress, BridgeSpec
from ..mqtt.client import ClientSession

__all__ = ["Side", "open_remote", "tls_context"]

_TLS_VERSIONS = {
    "tlsv1.1": ssl.TLSVersion.TLSv1_1,
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
}


class Side:
    """A session and its connection of the moment: what the bridge's tasks write through.

    Both the side's own reader and the other side's (forwarding a message, chaining an
    acknowledgement) queue bytes on the session; :meth:`flush` sends them, one writer at
    a time, since a trio stream takes one ``send_all`` at a time.
    """

    def __init__(self, name: str, session: ClientSession) -> None:
        self.name = name
        self.session = session
        self.stream: trio.abc.Stream | None = None
        self.watch: idlekeeper.WatchedStream | None = None
        """The keeper's watch of the connection (its receive deadline), while there is one."""
        self.up = False
        """Connected: the CONNACK accepted the CONNECT on the current connection."""
        self._lock = trio.Lock()

    async def flush(self) -> None:
        """Send what the session queued. With no connection the bytes are dropped: the
        session's next :meth:`~..mqtt.client.ClientSession.connect` would discard them
        anyway, and keeps its messages to send again itself."""
        async with self._lock:
            data = self.session.bytes_to_send()
            stream = self.stream
            if not data or stream is None:
                return
            # A broken connection: the reader sees it end and reconnects; what was lost
            # here is still held by the session (QoS 1/2) or was QoS 0.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(data)


def tls_context(spec: BridgeSpec) -> ssl.SSLContext:
    """The client TLS context of the bridge's ``bridge_*`` files and settings."""
    context = ssl.create_default_context(cafile=spec.bridge_cafile, capath=spec.bridge_capath)
    if spec.bridge_certfile is not None:
        context.load_cert_chain(spec.bridge_certfile, spec.bridge_keyfile)
    if spec.bridge_insecure:
        # Mosquitto's bridge_insecure: the chain is still checked, the name is not.
        context.check_hostname = False
    if spec.bridge_tls_version is not None:
        context.minimum_version = _TLS_VERSIONS[spec.bridge_tls_version]
    if spec.bridge_alpn is not None:
        context.set_alpn_protocols([spec.bridge_alpn])
    return context


async def open_remote(spec: BridgeSpec, address: BridgeAddress, context: ssl.SSLContext | None) -> trio.abc.Stream:
    """A connection to ``address``, TLS-wrapped (handshake done) when ``context`` is given.
    The caller bounds the time it may take."""
    stream = await trio.open_tcp_stream(address.host, address.port, local_address=spec.bridge_bind_address)
    if context is None:
        return stream
    tls = trio.SSLStream(stream, context, server_hostname=address.host)
    try:
        await tls.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return tls
