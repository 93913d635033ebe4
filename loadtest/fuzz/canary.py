"""The canary of ``python -m loadtest fuzz``: well-behaved clients beside the fuzzer, in a
process of their own, so that the fuzzer's load never starves them.

    python -m loadtest.fuzz.canary --protocol mqtt|http|ws|mqtt-ws --port P --tag T [--no-presence]

It connects, prints one JSON line (``{"ready": true}``) on stdout, keeps its clients
busy until its stdin is closed, then stops them cleanly and prints its
:class:`~.observation.CanaryReport` as one JSON line, with ``peers``: every address its
connections had (the judge leaves them out of the fuzz connections' accounting).

- MQTT (:class:`~.canary_mqtt.MqttCanary`): :data:`~.canary_mqtt.CANARY_DEVICES`
  devices pinging every :data:`~.canary_mqtt.CANARY_INTERVAL` s with keep-alive
  :data:`~.canary_mqtt.CANARY_KEEPALIVE`, a subscriber to their presence topics that
  must hear them come online and never go offline, and a new connection every
  :data:`~.canary_base.PROBE_INTERVAL` s that must get CONNACK 0. With
  ``--no-presence`` (a peer that publishes no presence, Mosquitto) no subscriber.
  ``mqtt-ws``: the same clients over WebSockets (:data:`MQTT_WS_PATH`), every one of them.
- HTTP (:class:`~.canary_http.HttpCanary`): one keep-alive connection alternating
  ``GET /healthz`` and ``POST /echo``, each 200 with the right body, and a new
  connection every :data:`~.canary_base.PROBE_INTERVAL` s that must get 200.
- WebSocket (:class:`~.canary_ws.WsCanary`): one WebSocket to the echo app, sending
  text and binary messages in turn, each echoed intact, answering the server's pings;
  and a new WebSocket every :data:`~.canary_base.PROBE_INTERVAL` s whose message is
  echoed and whose close is answered with 1000.

A reply slower than :data:`~.canary_base.CANARY_LATENCY` is a problem. So is a pause of
the canary itself as long as the server's keep-alive window: its own silence could then
explain a drop, and its verdict would be void.

This module is the command: it picks the canary for the protocol, runs it and prints
its report. What the canaries share is :mod:`.canary_base`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence

import trio

from ..options import command_parser
from .canary_http import HttpCanary
from .canary_mqtt import MqttCanary
from .canary_ws import WsCanary

__all__ = ["main"]

MQTT_WS_PATH = "/mqtt"
"""Where the heartbeat server's WebSocket listener serves MQTT (its default ``--ws-path``)."""


async def serve(protocol: str, port: int, tag: str, presence: bool = True) -> None:
    """Run the canary until stdin closes; print the ready line, then the report."""
    canary: MqttCanary | HttpCanary | WsCanary
    if protocol in ("mqtt", "mqtt-ws"):
        canary = MqttCanary(port, tag, presence, MQTT_WS_PATH if protocol == "mqtt-ws" else None)
    else:
        canary = HttpCanary(port, tag) if protocol == "http" else WsCanary(port, tag)
    async with trio.open_nursery() as nursery:
        await canary.start(nursery)
        print(json.dumps({"ready": True}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the fuzzer closes our stdin
        await canary.stop()
        nursery.cancel_scope.cancel()
    report = dataclasses.asdict(canary.report)
    report["peers"] = sorted(canary.peers)
    print(json.dumps(report), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.fuzz.canary``."""
    p = command_parser("python -m loadtest.fuzz.canary", __doc__)
    p.add_argument("--protocol", choices=("mqtt", "http", "ws", "mqtt-ws"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tag", required=True, help="makes the canary's client ids unique to the run")
    p.add_argument("--no-presence", action="store_true", help="MQTT: the server publishes no presence (a peer)")
    args = p.parse_args(argv)
    trio.run(serve, args.protocol, args.port, args.tag, not args.no_presence)
    return 0


if __name__ == "__main__":
    sys.exit(main())
