"""Starting a worker's bridges: each :class:`~.runtime.Bridge` connected to the first
plain ``mqtt://`` listener of the server it runs beside."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

import idlekeeper

from ..bridge import BridgeSpec
from ..mqtt.publication import Publication
from ..server.doors import Door
from ..server.lifecycle import HeartbeatServer
from .runtime import Bridge

__all__ = ["NoPlainListener", "announcer", "local_address", "start_bridges"]

_ANY = ("", "0.0.0.0", "::")


class NoPlainListener(ValueError):
    """A bridge needs a plain MQTT listener to join its own broker through."""


def local_address(doors: Sequence[Door]) -> tuple[str, int]:
    """Where a bridge connects to its own server: the first plain MQTT listener, over
    loopback when it listens on every address."""
    for door in doors:
        if door.websockets or door.listener.tls is not None:
            continue
        address = door.spec.address or ""
        host = "127.0.0.1" if address in _ANY else ("::1" if address == "::1" else address)
        return host, door.port
    raise NoPlainListener(
        "a bridge joins this server through a plain mqtt:// listener, and there is none "
        "(add one, on 127.0.0.1 if it is for the bridge only)"
    )


def announcer(server: HeartbeatServer, owner: str) -> Callable[[str, bytes], None]:
    """Publish as ``server`` itself, retained, on every worker (or gateway): a bridge's
    state, on a ``$SYS`` topic no client may publish to."""

    def announce(topic: str, payload: bytes) -> None:
        server.coordinator.retain(topic, payload, 1, owner)
        server.fanout.route(Publication(topic, payload, 1, True))

    return announce


def start_bridges(
    specs: Sequence[BridgeSpec], server: HeartbeatServer, keeper: idlekeeper.Keeper, nursery: trio.Nursery
) -> list[Bridge]:
    """Start a bridge per spec of ``server`` in ``nursery``. Not waited for: a bridge
    whose local side cannot get in (its local credentials refused) retries and logs
    why, and must not hold the worker's start up."""
    host, port = local_address(server.doors)
    bridges = []
    for spec in specs:
        announce = announcer(server, spec.local_id())
        bridges.append(Bridge(spec, port, keeper, local_host=host, announce=announce))
    for bridge in bridges:
        nursery.start_soon(bridge.run)
    return bridges
