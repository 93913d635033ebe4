"""The healthy clients beside an attack, in processes of their own so that neither
the attacker's load nor each other's delays their measurements:

    python -m loadtest.abuse.fleet --port P [--devices 20] [--interval 0.1]
        [--probe-interval 0.5] [--healthz PORT] [--presence --expect N] [--tag T]

- ``--devices`` devices connect and send a PINGREQ every ``--interval`` s, whatever
  came back, so that a server that stalls is seen in every ping queued behind; each
  round trip is kept with when it was sent;
- a reconnect every ``--probe-interval`` s (0: none), with a client id of its own,
  must get CONNACK 0;
- with ``--healthz``, ``GET /healthz`` on that status port every ``--healthz-interval`` s;
- with ``--presence`` (ours), a subscriber to ``$SYS/presence/#`` keeps a record of every
  message it is sent (:func:`~.presence_audit.seen`). It runs in a process of its own,
  started first (``--devices 0``) so it hears every device come online: presence
  messages can be 60 KB each under attack, and reading them must not delay a ping.
  At the end it waits for the offline events of the ``--expect`` devices.

It prints one JSON line (``{"ready": true}``) once everything is connected, runs
until its stdin is closed, then DISCONNECTs every client, and prints its
:class:`~.observation.FleetReport` as one JSON line. Pings not answered by then
count as unanswered (an infinite round trip).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import trio

from ..options import command_parser
from .client import Client, open_socket
from .observation import FleetReport
from .presence_audit import PRESENCE_PREFIX, seen

__all__ = ["Fleet", "device_ids", "main"]

KEEP_ALIVE = 30
"""The devices' keep-alive: far longer than a run's pauses, so only the server can drop them."""
REPLY_TIMEOUT = 5.0
"""Seconds a CONNACK, SUBACK or /healthz answer may take before it counts as missing."""
LAG_STEP = 0.05
LAG_NOTED = 0.02
"""The fleet's own loop late by more than this (s) is noted."""
ANSWER_GRACE = 1.0
"""Seconds given to pings in flight at the end to be answered."""


def device_ids(tag: str, devices: int) -> list[str]:
    """The healthy devices' client ids."""
    return [f"{tag}-device-{i}" for i in range(devices)]


class Fleet:
    """Healthy clients beside the attacker: see the module's docstring."""

    def __init__(self, port: int, devices: int, tag: str, source: str = "127.0.0.1", expect: int = 0) -> None:
        self.port = port
        self.expected = device_ids(tag, expect)
        """The devices whose offline events the subscriber waits for at the end."""
        self.source = source
        self.tag = tag
        self.report = FleetReport(devices=device_ids(tag, devices))
        self.clients: list[Client] = []
        self.stopping = False
        self.probing_one = False
        """A probe is connecting or saying goodbye (the end waits for it)."""
        self.subscriber: Client | None = None

    def _dropped(self, name: str, client: Client) -> None:
        if not self.stopping:
            self.report.dropped.append(f"{name} closed by the server at {client.closed_at:.3f}")

    async def _watch(self, name: str, client: Client) -> None:
        await client.until(lambda: False, math.inf)
        self._dropped(name, client)

    async def _device(self, nursery: trio.Nursery, client_id: str) -> Client:
        client = await Client.start(nursery, self.port, self.source, on_rtt=self._rtt)
        code = await client.connect(client_id, REPLY_TIMEOUT, KEEP_ALIVE)
        if code != 0:
            raise RuntimeError(f"healthy device {client_id} not accepted: CONNACK {code}")
        nursery.start_soon(self._watch, client_id, client)
        return client

    def _all_offline(self) -> bool:
        gone = {p.client_id for p in self.report.presence if p.status == "offline"}
        # And every probe seen online: in a fleet its offline event comes through Redis,
        # later than the subscriber's round trip to its gateway.
        probes = {p.client_id for p in self.report.presence if p.status == "online"}
        probes = {c for c in probes if c is not None and c.startswith(f"{self.tag}-probe-")}
        # And every probe the server accepted, heard online yet or not: the last one's
        # events may still be on their way when the end begins.
        report = self.report
        probes.update(
            c for c, (_, outcome, _) in zip(report.probe_ids, report.probes, strict=False) if outcome == "connack-0"
        )
        return all(client_id in gone for client_id in [*self.expected, *probes])

    def _rtt(self, sent: float, rtt: float) -> None:
        self.report.pings.append((sent, rtt))

    async def subscribe(self, nursery: trio.Nursery) -> None:
        """The presence subscriber, before any device, so it hears every one come online."""

        def heard(topic: str, payload: bytes, retain: bool) -> None:
            if topic.startswith(PRESENCE_PREFIX):
                self.report.presence.append(seen(topic, payload, retain))

        client = await Client.start(nursery, self.port, self.source, on_publish=heard)
        name = f"{self.tag}-presence"
        if await client.connect(name, REPLY_TIMEOUT, KEEP_ALIVE) != 0:
            raise RuntimeError("the presence subscriber was not accepted")
        codes = await client.subscribe(1, [PRESENCE_PREFIX + "#"], REPLY_TIMEOUT)
        if codes is None or codes[:1] not in (b"\x00", b"\x01"):
            raise RuntimeError(f"{PRESENCE_PREFIX}# not granted: SUBACK {codes!r}")
        self.report.subscribed = (time.time(), 0.0)
        self.subscriber = client
        nursery.start_soon(self._watch, name, client)

    async def connect(self, nursery: trio.Nursery) -> None:
        """Every device, a few at a time."""
        for first in range(0, len(self.report.devices), 16):
            async with trio.open_nursery() as batch:
                for client_id in self.report.devices[first : first + 16]:
                    batch.start_soon(self._connect_one, nursery, client_id)

    async def _connect_one(self, nursery: trio.Nursery, client_id: str) -> None:
        self.clients.append(await self._device(nursery, client_id))

    async def pinging(self, interval: float) -> None:
        """Every device pings every ``interval`` s, spread over the interval."""
        async with trio.open_nursery() as nursery:
            for i, client in enumerate(self.clients):
                nursery.start_soon(self._ping_loop, client, interval, interval * i / max(1, len(self.clients)))

    async def _ping_loop(self, client: Client, interval: float, offset: float) -> None:
        await trio.sleep(offset)
        while not self.stopping and not client.closed:
            if not await client.ping():
                return
            await trio.sleep(interval)

    async def probing(self, interval: float) -> None:
        """A reconnect every ``interval`` s, each under a client id of its own."""
        n = 0
        while not self.stopping:
            await trio.sleep(interval)
            client_id = f"{self.tag}-probe-{n}"
            n += 1
            self.report.probe_ids.append(client_id)
            began = time.monotonic()
            outcome = f"no CONNACK within {REPLY_TIMEOUT:g} s"
            self.probing_one = True
            try:
                async with trio.open_nursery() as nursery:
                    client = await Client.start(nursery, self.port, self.source)
                    code = await client.connect(client_id, REPLY_TIMEOUT, KEEP_ALIVE)
                    if code >= 0:
                        outcome = f"connack-{code}"
                    elif client.closed:
                        outcome = "closed without CONNACK"
                    await client.disconnect()
            except (OSError, trio.TooSlowError) as exc:
                outcome = f"connect failed: {exc!r}"
            finally:
                self.probing_one = False
            self.report.probes.append((began, outcome, time.monotonic() - began))

    async def polling(self, port: int, interval: float) -> None:
        """``GET /healthz`` every ``interval`` s."""
        while not self.stopping:
            began = time.monotonic()
            self.report.healthz.append((began, await _healthz(self.source, port)))
            await trio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def lagging(self) -> None:
        """Note when this process's own loop was late (its measurements then are suspect)."""
        while not self.stopping:
            before = time.monotonic()
            await trio.sleep(LAG_STEP)
            late = time.monotonic() - before - LAG_STEP
            if late > LAG_NOTED:
                self.report.lag.append((before, late))

    async def stop(self) -> None:
        """Let pings in flight be answered, then say goodbye, the subscriber last."""
        self.stopping = True
        with trio.move_on_after(ANSWER_GRACE):
            while any(c.pings for c in self.clients if not c.closed):  # noqa: ASYNC110 - a few polls at the end
                await trio.sleep(0.02)
        with trio.move_on_after(REPLY_TIMEOUT):
            while self.probing_one:  # noqa: ASYNC110 - the last probe finishes within its timeouts
                await trio.sleep(0.02)
        for client in self.clients:
            self.report.pings.extend((sent, math.inf) for sent in client.pings)
            if not client.closed:
                await client.disconnect()
        sub = self.subscriber
        if sub is not None:
            # Each device's offline event, read before the subscriber goes: the judge
            # counts every healthy event of its window as due.
            await sub.until(self._all_offline, REPLY_TIMEOUT)
            await sub.round_trip(REPLY_TIMEOUT)
            self.report.subscribed = (self.report.subscribed[0], time.time())
            if not sub.closed:
                await sub.disconnect()


async def _healthz(source: str, port: int) -> str:
    try:
        with trio.move_on_after(REPLY_TIMEOUT):
            stream = await open_socket(port, source, REPLY_TIMEOUT)
            async with stream:
                await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                head = b""
                while b"\r\n" not in head:
                    data = await stream.receive_some(4096)
                    if not data:
                        return "closed"
                    head += data
                parts = head.split(b" ", 2)
                return parts[1].decode() if len(parts) > 1 else "garbled"
        return "timeout"
    except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
        return f"error: {type(exc).__name__}"


async def _stdin_closed() -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass


def _say(data: object) -> None:
    print(json.dumps(data), flush=True)


async def run(args: argparse.Namespace) -> FleetReport:
    """Connect the fleet, report ready, keep it busy until stdin closes, then stop it."""
    fleet = Fleet(args.port, args.devices, args.tag, args.source, args.expect)
    async with trio.open_nursery() as nursery:
        if args.presence:
            await fleet.subscribe(nursery)
        await fleet.connect(nursery)
        async with trio.open_nursery() as busy:
            busy.start_soon(fleet.lagging)
            if fleet.clients:
                busy.start_soon(fleet.pinging, args.interval)
            if args.probe_interval > 0:
                busy.start_soon(fleet.probing, args.probe_interval)
            if args.healthz:
                busy.start_soon(fleet.polling, args.healthz, args.healthz_interval)
            _say({"ready": True})
            await _stdin_closed()
            await fleet.stop()
        nursery.cancel_scope.cancel()
    return fleet.report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.abuse.fleet``."""
    p = command_parser("python -m loadtest.abuse.fleet", __doc__)
    a = p.add_argument
    a("--port", type=int, required=True, help="the MQTT server's port on 127.0.0.1")
    a("--source", default="127.0.0.1", help="the fleet's loopback source address (default: 127.0.0.1)")
    a("--devices", type=int, default=20, help="healthy devices pinging (default: 20)")
    a("--interval", type=float, default=0.1, help="seconds between a device's PINGREQs (default: 0.1)")
    a("--probe-interval", type=float, default=0.5, help="seconds between reconnects, 0 for none (default: 0.5)")
    a("--presence", action="store_true", help=f"subscribe to {PRESENCE_PREFIX}# and keep every message")
    a("--expect", type=int, default=0, help="with --presence: devices whose offline events to wait for at the end")
    a("--healthz", type=int, default=None, help="poll GET /healthz on this status port")
    a("--healthz-interval", type=float, default=0.5, help="seconds between polls (default: 0.5)")
    a("--tag", default="healthy", help="client ids start with this (default: healthy)")
    args = p.parse_args(argv)
    try:
        report = trio.run(run, args)
    except Exception as exc:  # whatever stopped it (a group, from the nursery) is the fleet's answer
        _say({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _say(report.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
