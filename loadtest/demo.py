"""The main job (``make demo``): the heartbeat server, 20,000 devices, a share going silent, a report.

    python -m loadtest demo [--devices 20000] [--keepalive 10] [--silent 0.1] [--stall]

It is ``python -m loadtest devices`` on defaults that fit a fresh machine: the
heartbeat server (``servers.heartbeat``) with two SO_REUSEPORT workers, two
generator processes of 10,000 devices each (their heartbeats on idlekeeper's own
timing wheel), half of them speaking MQTT 5.0 and half 3.1.1, 10% of the devices
going silent with their sockets left open (dead devices whose TCP never closed), 1%
vanishing with a reset and 1% reconnecting under the same client id. Progress is
live; the report says how many dead devices were found, how late (never before
1.5 x keep-alive after their last packet; at most one tick after), whether any
healthy device was dropped (there must be none), what the 5.0 devices were told
(DISCONNECT 0x8D, keep-alive timeout; 0x8E, taken over), the server's memory per
device, and where the JSON and the plots are.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import devices
from .mqtt_versions import canonical

__all__ = ["main"]

DEFAULTS = {
    "devices": 20_000,
    "keepalive": 10,
    "silent": 0.10,
    "vanish": 0.01,
    "reconnect": 0.01,
    "protocol": canonical("mixed"),  # half the fleet MQTT 5.0: the silent ones are told why (0x8D)
    "json": "results/demo.json",
    "plots": "results/plots",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit 0 only if every check passed."""
    p = devices.parser("python -m loadtest demo")
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.set_defaults(**DEFAULTS)
    args = p.parse_args(argv)
    print(
        f"idlekeeper demo: {args.devices:,} MQTT devices, keep-alive {args.keepalive} s "
        f"(dead after {1.5 * args.keepalive:g} s of silence); {args.silent:.0%} go silent, "
        f"{args.vanish:.0%} vanish, {args.reconnect:.0%} reconnect; MQTT {args.protocol}"
        + (", then a server stall" if args.stall else ""),
        flush=True,
    )
    return devices.main_with(args)


if __name__ == "__main__":
    sys.exit(main())
