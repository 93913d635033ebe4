"""The MQTT state a coordinator keeps for a worker (persistent sessions, retained
messages), made as the worker's configuration bounds it."""

from __future__ import annotations

from collections.abc import Callable

from ..broker.persistent import SessionStore
from ..broker.retained import RetainedStore
from ..config import HeartbeatConfig
from ..coordination.durable import Durability
from ..coordination.retention import MqttState
from .access import acl_reader

__all__ = ["durability_for", "mqtt_state", "session_store"]


def mqtt_state(config: HeartbeatConfig) -> MqttState:
    """The sessions and retained messages a coordinator keeps, bounded as ``config`` says."""
    return MqttState(
        session_store(config),
        RetainedStore(
            max_bytes=config.max_retained_bytes,
            max_owner_count=config.max_retained_per_client,
            max_owner_bytes=config.max_retained_bytes_per_client,
        ),
        retain_presence=config.retain_presence,
        presence_offline_ttl=config.presence_offline_ttl,
    )


def session_store(config: HeartbeatConfig) -> SessionStore:
    """The persistent sessions' store, bounded as ``config`` says, reading the ACL in force."""
    return SessionStore(
        max_qos=config.max_qos,
        window=config.max_inflight,
        window_bytes=config.max_inflight_bytes,
        max_queued=config.max_queued,
        max_queued_bytes=config.max_queued_bytes,
        expiry=config.session_expiry,
        max_sessions=config.max_persistent_sessions,
        may_read=acl_reader(config, config.listeners or ()),
        # A bridge's local session holds what its remote is owed: by bytes, not by count.
        bridges=[spec.local_id() for spec in config.bridges if not spec.local_clean],
    )


def durability_for(config: HeartbeatConfig, store_clock: Callable[[], float]) -> Durability | None:
    """The durable store ``config`` asks for (None: the state lives in memory), whose
    session store runs on ``store_clock``."""
    if config.persistence is None:
        return None
    return Durability(
        config.persistence,
        sync=config.persistence_sync,
        interval=config.persistence_interval,
        autosave=config.autosave_interval,
        store_clock=store_clock,
        check=config.persistence_check,
    )
