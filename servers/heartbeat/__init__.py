"""The MQTT presence server on idlekeeper: MQTT 3.1, 3.1.1 and 5.0 over TCP, TLS and
WebSockets, keep-alive kept by the timing wheel, telling which devices are alive and
which died, on one box or a Redis fleet. Run it with ``python -m servers.heartbeat``.

Its rooms, each importing only from those below it (``tests/test_layout.py`` holds
them to it)::

    __main__.py auth.py            the commands
    worker.py conf/                one worker, its parts started in the order they need;
                                   a Mosquitto configuration file read as options
    bridging/                      a bridge to another broker, running
    transports/                    the engines that carry a connection's bytes
    settings.py server/            every option, declared once; a connection's life, on trio
    config.py                      the settings as a worker takes them
    coordination/ listener.py      what workers and gateways share (fleet/: on Redis);
    bridge/                        one listener, and one bridge (a connection section)
                                   with its topic mapping, as an operator writes them
    presence/ broker/ security/    presence events; routing and stored state; the rules
    mqtt/                          the protocol, sans-IO

``HeartbeatConfig``, ``serve_heartbeat``, ``PresenceEvent`` and ``Offline`` are
importable from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import HeartbeatConfig
    from .presence import Offline, PresenceEvent
    from .worker import serve_heartbeat

__all__ = ["HeartbeatConfig", "Offline", "PresenceEvent", "serve_heartbeat"]

_HOMES = {"HeartbeatConfig": "config", "Offline": "presence", "PresenceEvent": "presence", "serve_heartbeat": "worker"}


def __getattr__(name: str) -> Any:
    # Looked up on first use: importing one room (the sans-IO mqtt/, say) must not load
    # trio and the whole server with it.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
