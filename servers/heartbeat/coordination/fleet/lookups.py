"""What a node reads of the fleet's registry when asked: one device's record (the
status endpoint's ``/devices/<client-id>``) and the counts and latest ends the
operator's page shows. Each is one round trip (a pipeline for the counts), bounded in
time; None when Redis does not answer, for the caller to say so."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import trio

from ...presence.event import PresenceEvent
from ...presence.overview import RecentEnds, registry_overview
from .keys import FleetKeys
from .link import RedisLink

__all__ = ["device_record", "fleet_overview"]


async def device_record(link: RedisLink, keys: FleetKeys, client_id: str) -> PresenceEvent | None:
    """``client_id``'s record, from Redis; None if unknown, forgotten, or Redis does not
    answer within the link's ``timeout``."""
    redis = link.client
    if redis is None:
        return None
    try:
        with trio.fail_after(link.timeout):
            record = keys.shard(client_id).dev_prefix + client_id
            status, raw = await redis.hmget(record, ["status", "event"])
    except (Exception, trio.TooSlowError) as exc:
        link.failed(exc)
        return None
    if raw is None or status == b"forgotten":
        return None
    return PresenceEvent.from_dict(json.loads(raw))


async def fleet_overview(
    link: RedisLink,
    keys: FleetKeys,
    members: Callable[[], Awaitable[Collection[str]]],
    recent: RecentEnds,
    query: str,
    limit: int,
) -> dict[str, Any] | None:
    """Online devices counted in Redis (each member node's set of held devices, in every
    shard, in one pipeline; a node lost and not yet swept still counts, as its devices'
    records still say online), with the latest ends as ``recent`` holds them (this node's
    reader reads every node's). None if Redis does not answer within twice the link's ``timeout``."""
    redis = link.client
    if redis is None:
        return None
    try:
        with trio.fail_after(link.timeout * 2):
            names = sorted(await members())
            async with redis.pipeline(transaction=False) as pipe:
                requests = [pipe.scard(shard.owned_prefix + m) for shard in keys.shards for m in names]
            online = sum([int(await request) for request in requests])
    except (Exception, trio.TooSlowError) as exc:
        link.failed(exc)
        return None
    # Counting offline records would take a scan of every device's: not for a page.
    return registry_overview("fleet", online, None, recent, query, limit) | {"nodes": names}
