"""Starting a worker's bridges: each :class:`~.runtime.Bridge` connected to the first
plain ``mqtt://`` listener of the server it runs beside; in a fleet, run by one gateway
at a time (:func:`on_duty`), so that the remote sees each message once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

import trio

import idlekeeper

from ..bridge import BridgeSpec
from ..coordination import Duty
from ..mqtt.publication import Publication
from ..server.doors import Door
from ..server.lifecycle import HeartbeatServer
from .runtime import Bridge

__all__ = ["FLEET_HOSTNAME", "NoPlainListener", "announcer", "local_address", "on_duty", "start_bridges"]

log = logging.getLogger("servers.heartbeat.bridge")

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


FLEET_HOSTNAME = "fleet"
"""What stands for the machine's name in a fleet's default bridge client ids
(``fleet.NAME``, ``local.fleet.NAME``): whichever gateway runs the bridge, the remote
and the fleet see one client, and its sessions carry over."""


def start_bridges(
    specs: Sequence[BridgeSpec], server: HeartbeatServer, keeper: idlekeeper.Keeper, nursery: trio.Nursery
) -> None:
    """Start a bridge per spec of ``server`` in ``nursery``. Not waited for: a bridge
    whose local side cannot get in (its local credentials refused) retries and logs
    why, and must not hold the worker's start up. In a fleet (the coordinator has
    duties) each runs at one gateway at a time: whichever holds its duty."""
    host, port = local_address(server.doors)
    for spec in specs:
        duty = server.coordinator.duty(f"bridge:{spec.name}")
        hostname = None if duty is None else FLEET_HOSTNAME
        announce = announcer(server, spec.local_id(hostname))
        make = partial(Bridge, spec, port, keeper, local_host=host, hostname=hostname, announce=announce)
        nursery.start_soon(make().run if duty is None else partial(on_duty, make, duty, spec.name))


async def on_duty(make: Callable[[], Bridge], duty: Duty, name: str) -> None:
    """Run a bridge (each time a new one of ``make``) whenever this node holds ``duty``,
    and only then: a node that loses it (Redis away, or another took it over after a
    stall) stops its bridge at once; one that stops gives it up for another to take
    without waiting for it to lapse."""
    try:
        while True:
            if not await duty.hold():
                await trio.sleep(duty.renew_every)
                continue
            log.info("bridge %s: this gateway runs it for the fleet", name)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(make().run)
                while True:
                    await trio.sleep(duty.renew_every)
                    if not await duty.hold():
                        break
                nursery.cancel_scope.cancel()
            log.warning("bridge %s: stopped here: this gateway no longer holds it (another may)", name)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await duty.release()
