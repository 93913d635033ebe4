"""The workload of ``python -m loadtest ws``: each part's size and duration, every one
bounded, the flags they come from, and the small ``--quick`` run."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .connect import MAX_SOCKETS
from .mqtt import MqttWsLoad

__all__ = ["PARTS", "QUICK", "WsLoad"]

PARTS = ("idle", "echo", "dead", "slow", "mqtt")
"""The parts of a run, in the order they run."""


def _knob(default: float, low: float, high: float, help: str) -> Any:
    """A field with its bounds and its flag's help (the flag is the field's name)."""
    return field(default=default, metadata={"range": (low, high), "help": help})


@dataclass(frozen=True)
class WsLoad:
    """How big and how long each part is. Every figure has bounds: each loop of the run is
    bounded in count and time, and one client process holds at most 15,000 sockets."""

    connections: int = _knob(2000, 1, MAX_SOCKETS, "idle WebSockets per server for the memory figure")
    echo_clients: int = _knob(50, 1, 1000, "concurrent echo clients, one message in flight each")
    echo_duration: float = _knob(5.0, 0.5, 60, "seconds of each echo round")
    echo_size: int = _knob(16, 1, 65536, "bytes of each echo message")
    rounds: int = _knob(3, 1, 10, "echo rounds per server, taken in turn (the median is the figure)")
    dead: int = _knob(100, 1, MAX_SOCKETS // 2, "dead peers (they never read after the handshake), and as many healthy")
    ping_interval: float = _knob(1.0, 0.1, 30, "ping interval of the dead-peer part, seconds (every server)")
    ping_timeout: float = _knob(1.0, 0.1, 30, "pong timeout of the dead-peer part, seconds (those that have one)")
    dead_window: float = _knob(8.0, 1, 120, "seconds the dead and healthy peers are watched")
    slow_readers: int = _knob(20, 1, 1000, "peers that open /flood and stop reading")
    slow_window: float = _knob(20.0, 1, 120, "seconds the slow readers are watched")
    timeout: float = _knob(5.0, 1, 60, "the servers' HTTP header and keep-alive timeout, and our send timeout")
    tick: float = _knob(0.1, 0.01, 1, "our servers' keeper tick, seconds")
    mqtt_devices: int = _knob(1000, 1, MAX_SOCKETS, "MQTT-over-WebSocket devices per server")
    mqtt_silent: int = _knob(100, 0, MAX_SOCKETS, "of which go silent")
    mqtt_keepalive: int = _knob(2, 1, 60, "the devices' MQTT keep-alive, seconds")
    mqtt_grace: float = _knob(10.0, 1, 120, "seconds past the last silent device's deadline a server has to close it")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            low, high = f.metadata["range"]
            value = getattr(self, f.name)
            if not low <= value <= high:
                raise ValueError(f"--{f.name.replace('_', '-')} must be in [{low:g}, {high:g}] (got {value:g})")
        if self.mqtt_silent > self.mqtt_devices:
            raise ValueError("--mqtt-silent must not exceed --mqtt-devices")

    @property
    def mqtt(self) -> MqttWsLoad:
        """The MQTT part's fleet."""
        return MqttWsLoad(
            devices=self.mqtt_devices, silent=self.mqtt_silent, keepalive=self.mqtt_keepalive, grace=self.mqtt_grace
        )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """A flag per field (``--echo-clients`` for ``echo_clients``), with its default."""
        for f in dataclasses.fields(WsLoad):
            kind = type(f.default)
            parser.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=kind,
                default=None,
                help=f"{f.metadata['help']} (default: {f.default:g}; --quick: {getattr(QUICK, f.name):g})",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, quick: bool = False) -> WsLoad:
        """The workload from the flags: each one given, else the default (or ``--quick``'s)."""
        base = QUICK if quick else cls()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}
        return dataclasses.replace(base, **given)


QUICK = WsLoad(
    connections=200,
    echo_clients=10,
    echo_duration=1.0,
    rounds=1,
    dead=20,
    dead_window=4.0,
    slow_readers=5,
    slow_window=8.0,
    mqtt_devices=100,
    mqtt_silent=10,
    mqtt_grace=8.0,
)
"""A run of about two minutes for all the servers: small counts, short windows."""
