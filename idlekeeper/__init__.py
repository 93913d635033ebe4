"""idlekeeper: connection timeouts for trio servers, kept in a timing wheel by one reaper.

Quick start::

    async with idlekeeper.open_keeper() as keeper:
        await idlekeeper.serve_tcp(handler, 8080, keeper=keeper, idle=30)

See :func:`open_keeper`, :meth:`Keeper.watch` and :class:`WatchedStream`.
"""

from typing import TYPE_CHECKING, Any

from .deadlines import ConnectionDeadlines, Reason
from .epochs import Epoch, EpochClock
from .keeper import Keeper, open_keeper
from .lost import EngineClosed, Expired
from .protocol import Protocol
from .serve import Handler, serve_listeners, serve_tcp
from .stats import HandshakeFailure, KeeperStats, LagHistogram
from .timers import TimerHandle, Timers
from .tls import DEFAULT_HANDSHAKE_TIMEOUT, peer_certificate, peer_common_name
from .transport import Transport
from .watch import ExpireHook, HalfCloseableWatchedStream, Watch, WatchedStream, WatchState
from .wheel import TimingWheel, WheelEntry

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "ConnectionDeadlines",
    "Engine",
    "EngineClosed",
    "Epoch",
    "EpochClock",
    "Expired",
    "ExpireHook",
    "HandshakeFailure",
    "HalfCloseableWatchedStream",
    "Handler",
    "Keeper",
    "KeeperStats",
    "LagHistogram",
    "Protocol",
    "Reason",
    "TimerHandle",
    "Timers",
    "Transport",
    "TimingWheel",
    "Watch",
    "WatchState",
    "WatchedStream",
    "WheelEntry",
    "open_engine",
    "open_keeper",
    "peer_certificate",
    "peer_common_name",
    "serve_listeners",
    "serve_protocol",
    "serve_tcp",
]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .engine import Engine, open_engine, serve_protocol

_ENGINE_NAMES = ("Engine", "open_engine", "serve_protocol")


def __getattr__(name: str) -> Any:
    """The dense engine's names, imported when first asked for: it needs Linux, and
    ``import idlekeeper`` must work wherever trio runs (off Linux, asking for one of
    them raises an ImportError that says so)."""
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
