"""TCP connections on loopback as the kernel lists them (``/proc/net/tcp``): how the
benchmark sees an edge drop its connection to a stopped remote, the same way for
both kinds of edge (Mosquitto 2.0.11 publishes no local ``0`` when it gives up)."""

from __future__ import annotations

from pathlib import Path

ESTABLISHED = "01"
TABLE = Path("/proc/net/tcp")


def client_sockets(server_port: int) -> dict[int, str]:
    """The loopback connections to ``server_port`` from a client's side: local port, state."""
    out: dict[int, str] = {}
    try:
        lines = TABLE.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        local, remote, state = fields[1], fields[2], fields[3]
        if int(remote.rpartition(":")[2], 16) == server_port:
            out[int(local.rpartition(":")[2], 16)] = state
    return out


def bridge_socket(server_port: int, ours: set[int]) -> int | None:
    """The one established connection to ``server_port`` whose local port is not in
    ``ours`` (the benchmark's own clients): the bridge's; None unless exactly one."""
    found = [p for p, s in client_sockets(server_port).items() if s == ESTABLISHED and p not in ours]
    return found[0] if len(found) == 1 else None


def established(server_port: int, local_port: int) -> bool:
    return client_sockets(server_port).get(local_port) == ESTABLISHED
