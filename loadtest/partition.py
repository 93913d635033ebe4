"""Network partitions on this machine: a process in a network namespace of its own
(an *island*), joined to the host by two veth pairs, one its devices reach it by and
one it reaches Redis by, either of which can be cut and healed.

A link is cut one of two ways; either way packets are lost both ways, with no RST
or FIN, and TCP connections over it stall and resume when it is healed (if neither
end gave up meanwhile):

- ``"drop"`` (the default): both ends stay up and send each other's packets to a
  hardware address no one has. Nothing on either side notices, as when a partition
  is somewhere along the path (a switch, a NAT or a firewall that dropped the flow):
  TCP retransmits into the void, its backoff growing, until the link heals.
- ``"down"``: the host's end of the veth pair is set down, as when a cable is pulled;
  the host's route to the island goes with it.

The addresses are link-local (169.254.0.0/16): they are never routed off the machine.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` (iproute2). :meth:`Island.remove`
deletes the namespace and both pairs; nothing else on the machine is changed. Every
process started in the island is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["Island", "island", "partitions_possible"]

_NOWHERE = "02:00:00:00:00:01"
"""A locally administered hardware address that no interface here has: frames sent to
it are dropped by the veth peer that receives them."""


def _ip(*words: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *words], capture_output=True, text=True, check=check, timeout=10.0)


def partitions_possible() -> str | None:
    """None if islands can be made here, else why not."""
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    probe = f"ik-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Island:
    """A network namespace with two links to the host:

    - ``devices``: the host reaches the island at :attr:`address` (its servers listen there);
    - ``backend``: the island reaches the host at :attr:`host_backend` (Redis listens there).
    """

    def __init__(self, number: int | None = None) -> None:
        self.number = number if number is not None else 1 + os.getpid() % 250
        n = self.number
        self.namespace = f"ik-island-{os.getpid()}-{n}"
        self.links = {"devices": (f"ikd{n}h", f"ikd{n}n"), "backend": (f"ikb{n}h", f"ikb{n}n")}
        self.host_devices, self.address = f"169.254.{n}.1", f"169.254.{n}.2"
        self.host_backend, self.backend_address = f"169.254.{n}.5", f"169.254.{n}.6"
        self.addresses = {
            "devices": (self.host_devices, self.address),
            "backend": (self.host_backend, self.backend_address),
        }
        """Each link's two addresses: the host's end, the island's."""
        self.cut_how: dict[str, str] = {}
        """The links cut now, and how."""
        self.made = False

    def make(self) -> None:
        """Make the namespace and both links, up."""
        _ip("netns", "add", self.namespace)
        self.made = True
        ns = ["ip", "netns", "exec", self.namespace]
        subprocess.run([*ns, "ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10.0)
        for name, (host_end, island_end) in self.links.items():
            host_ip, island_ip = self.addresses[name]
            _ip("link", "add", host_end, "type", "veth", "peer", "name", island_end)
            _ip("link", "set", island_end, "netns", self.namespace)
            _ip("addr", "add", f"{host_ip}/30", "dev", host_end)
            _ip("link", "set", host_end, "up")
            inside = [*ns, "ip"]
            subprocess.run([*inside, "addr", "add", f"{island_ip}/30", "dev", island_end], check=True, timeout=10.0)
            subprocess.run([*inside, "link", "set", island_end, "up"], check=True, timeout=10.0)

    @property
    def prefix(self) -> list[str]:
        """What goes before a command to run it inside the island."""
        return ["ip", "netns", "exec", self.namespace]

    def cut(self, link: str, how: str = "drop") -> None:
        """Lose every packet on ``link`` ("devices" or "backend"), both ways; ``how`` is
        ``"drop"`` or ``"down"`` (see the module's docs)."""
        if how not in ("drop", "down"):
            raise ValueError(f"a link is cut by 'drop' or 'down', not {how!r}")
        if link in self.cut_how:
            raise RuntimeError(f"the {link} link is cut already")
        if how == "down":
            _ip("link", "set", self.links[link][0], "down")
        else:
            self._neighbours(link, "replace", "lladdr", _NOWHERE, "nud", "permanent")
        self.cut_how[link] = how

    def heal(self, link: str) -> None:
        """Carry packets on ``link`` again."""
        how = self.cut_how.pop(link, None)
        if how == "down":
            _ip("link", "set", self.links[link][0], "up")
        elif how == "drop":
            # Without the false entries, the ends find each other's address again (ARP).
            self._neighbours(link, "del")

    def _neighbours(self, link: str, verb: str, *options: str) -> None:
        """``ip neigh <verb>`` of each end's entry for the other end of ``link``."""
        host_end, island_end = self.links[link]
        host_ip, island_ip = self.addresses[link]
        for prefix, address, device in (([], island_ip, host_end), (self.prefix, host_ip, island_end)):
            command = [*prefix, "ip", "neigh", verb, address, *options, "dev", device]
            subprocess.run(command, check=True, capture_output=True, timeout=10.0)

    def remove(self) -> None:
        """Delete the namespace and both pairs (deleting either end of a pair deletes it)."""
        for host_end, _ in self.links.values():
            _ip("link", "del", host_end, check=False)
        if self.made:
            _ip("netns", "del", self.namespace, check=False)
            self.made = False


@contextlib.contextmanager
def island(number: int | None = None) -> Iterator[Island]:
    """A made :class:`Island`, removed on exit however the block ends."""
    made = Island(number)
    try:
        made.make()
        yield made
    finally:
        made.remove()
