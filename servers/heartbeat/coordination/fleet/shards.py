"""How a fleet's keys are laid out across Redis Cluster slots.

Redis Cluster runs a Lua script only if every key it touches is in one slot, and
a slot is served by one primary. The fleet's atomic step, a device's claim or end,
writes the device's record, a presence event and the owner's set of held devices
together; so those three live in one slot per **shard**, and devices are shared out
among the shards by client id (CRC-32, stable across processes and hosts). Everything
else (leases, filters, routes, persistent sessions, retained messages) is in one
**hub** slot, since one message may reach any session.

A key's slot is CRC-16 of its hash tag (the text between the first ``{`` and the
next ``}``) modulo 16,384. :func:`spread_tags` picks the shards' tags so that their
slots are evenly spaced over the slot space: ``redis-cli --cluster create`` gives each
primary a contiguous range, so the shards fall evenly on the primaries, and a
resharding that moves a range moves whole shards.

On one Redis (or Sentinel) there is one shard whose names are the hub's own, as
they always were: no braces, nothing changes for an existing deployment.

Pure: no I/O.
"""

from __future__ import annotations

import zlib

__all__ = ["HASH_SLOTS", "hash_slot", "shard_index", "spread_tags"]

HASH_SLOTS = 16384


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum Redis Cluster hashes keys with."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_slot(key: str | bytes) -> int:
    """The slot Redis Cluster puts ``key`` in (its hash tag's, if it has a non-empty one)."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return _crc16(data) % HASH_SLOTS


def spread_tags(count: int) -> list[str]:
    """``count`` short hash tags, the ``k``-th in the ``k``-th of ``count`` equal ranges
    of slots, and a last one for the hub, halfway into the first range (so the hub's
    slot is not a shard's)."""
    if not 1 <= count <= 1024:
        raise ValueError(f"shards: {count} is not between 1 and 1024")
    width = HASH_SLOTS / count
    wanted = [(int(k * width), int((k + 1) * width)) for k in range(count)]
    hub_low = int(width / 2)
    wanted.append((hub_low, hub_low + max(1, int(width / 4))))
    tags: list[str] = []
    taken: set[int] = set()
    for index, (low, high) in enumerate(wanted):
        name = "h" if index == count else f"s{index}"
        for attempt in range(1_000_000):
            tag = name if attempt == 0 else f"{name}.{attempt}"
            slot = hash_slot("{" + tag + "}")
            if low <= slot < high and slot not in taken:
                taken.add(slot)
                tags.append(tag)
                break
        else:  # pragma: no cover - the ranges are wide enough for CRC-16 to land in
            raise RuntimeError(f"no hash tag lands in slots {low}..{high}")
    return tags


def shard_index(client_id: str, count: int) -> int:
    """The shard a client id's presence keys are in."""
    if count == 1:
        return 0
    return zlib.crc32(client_id.encode("utf-8", "surrogatepass")) % count
