"""The baseline for ``python -m loadtest compare``: MQTT keep-alive with trio's own timeouts.

    python -m loadtest.baseline --port 1883 [--host 127.0.0.1] [--connect-timeout 10]

What a careful trio user writes without idlekeeper: the same sans-IO protocol code
as ``servers.heartbeat`` (its packet reader and :class:`~servers.heartbeat.mqtt.session.Session`),
a task per connection from ``trio.serve_tcp``, and one ``trio.move_on_after`` around
every read: 1.5 x keep-alive once connected, ``--connect-timeout`` before. A new
connection with a client id already online takes over (the old one is closed).
It keeps presence only (no routing), which is all the device workload needs.

It also freezes long-lived objects out of the garbage collector's scans every
``--gc-freeze`` seconds, as ``servers.heartbeat`` does by default, so that the
comparison measures the timeout machinery and not a collector policy only one side has.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from functools import partial

import trio

from servers.gcpolicy import freeze_long_lived
from servers.heartbeat.mqtt.effects import Accept, Send
from servers.heartbeat.mqtt.packets import ProtocolError
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.session import Session, State
from servers.listeners import port_of
from servers.readiness import Ready
from servers.runner import serve_until_signal

from .options import command_parser

__all__ = ["BaselineServer", "main"]


class BaselineServer:
    """One process, one task per connection, one cancel scope per read."""

    def __init__(self, connect_timeout: float = 10.0, max_packet_size: int = 256 * 1024) -> None:
        self.connect_timeout = connect_timeout
        self.max_packet_size = max_packet_size
        self.online: dict[str, trio.CancelScope] = {}
        self.expired = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection until the peer leaves, errs, is taken over or falls silent."""
        session = Session()
        reader = PacketReader(self.max_packet_size)
        timeout = self.connect_timeout
        client_id: str | None = None
        with trio.CancelScope() as scope:
            try:
                async with stream:
                    while session.state is not State.CLOSED:
                        data: bytes | None = None
                        with trio.move_on_after(timeout):
                            data = await stream.receive_some()
                        if data is None:
                            self.expired += 1  # the read timed out: the device is dead
                            return
                        if not data:
                            return
                        for packet in reader.feed(data):
                            for effect in session.receive(packet):
                                if isinstance(effect, Accept):
                                    client_id = effect.client_id
                                    old = self.online.get(client_id)
                                    if old is not None:
                                        old.cancel()
                                    self.online[client_id] = scope
                                    if effect.keep_alive:
                                        timeout = 1.5 * effect.keep_alive
                                    else:
                                        timeout = math.inf
                                    await stream.send_all(session.accepted())
                                elif isinstance(effect, Send):
                                    await stream.send_all(effect.data)
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                if client_id is not None and self.online.get(client_id) is scope:
                    del self.online[client_id]


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM."""
    server = BaselineServer(args.connect_timeout)

    async def start(nursery: trio.Nursery) -> int:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, args.port, host=args.host))
        if args.gc_freeze > 0:
            nursery.start_soon(freeze_long_lived, args.gc_freeze)
        return port_of(listeners)

    await serve_until_signal(start, lambda port: Ready("baseline", 0, args.host, port))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = command_parser("python -m loadtest.baseline", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=1883, help="TCP port (default: 1883)")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to send CONNECT (default: 10)")
    p.add_argument(
        "--gc-freeze",
        type=float,
        default=2.0,
        help="seconds between freezing long-lived objects out of the collector's scans, as servers.heartbeat does;"
        " 0: never (default: 2)",
    )
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)  # one process; for start_server
    trio.run(serve, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
