"""idlekeeper: connection timeouts for trio servers, kept in a timing wheel by one reaper.

Quick start::

    async with idlekeeper.open_keeper() as keeper:
        await idlekeeper.serve_tcp(handler, 8080, keeper=keeper, idle=30)

See :func:`open_keeper`, :meth:`Keeper.watch` and :class:`WatchedStream`. The names
in ``__all__`` are the API; :mod:`idlekeeper.wheel` and :mod:`idlekeeper.timers` are
pure data structures (no trio) that may be used on their own; everything else is
internal.
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from .deadlines import Reason
from .hooks import in_thread
from .keeper import Keeper, open_keeper
from .lost import EngineClosedError, ExpiredError, renamed
from .protocol import Protocol
from .serve import Handler, serve_listeners, serve_tcp
from .stats import HandshakeFailure, KeeperStats, LagHistogram
from .timers import TimerHandle
from .tls import DEFAULT_HANDSHAKE_TIMEOUT, peer_certificate, peer_common_name
from .tls_transport import TLSTransport
from .transport import Transport
from .watch import ExpireHook, HalfCloseableWatchedStream, LastWords, Watch, WatchedStream, WatchState

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "Engine",
    "EngineClosedError",
    "ExpireHook",
    "ExpiredError",
    "HalfCloseableWatchedStream",
    "Handler",
    "HandshakeFailure",
    "Keeper",
    "KeeperStats",
    "LagHistogram",
    "LastWords",
    "Protocol",
    "Reason",
    "TLSTransport",
    "TimerHandle",
    "Transport",
    "Watch",
    "WatchState",
    "WatchedStream",
    "in_thread",
    "open_engine",
    "open_keeper",
    "peer_certificate",
    "peer_common_name",
    "serve_listeners",
    "serve_protocol",
    "serve_tcp",
]

__version__ = "0.3.0"

if TYPE_CHECKING:
    from .engine import Engine, open_engine, serve_protocol

_ENGINE_NAMES = ("Engine", "open_engine", "serve_protocol")

# Building blocks that 0.1 exported here and that now live only in their modules
# (pure data structures, usable without trio), found there for a release with a warning.
_MOVED = {
    "TimingWheel": "wheel",
    "WheelEntry": "wheel",
    "Epoch": "epochs",
    "EpochClock": "epochs",
    "ConnectionDeadlines": "deadlines",
    "Timers": "timers",
}


def __getattr__(name: str) -> Any:
    """The dense engine's names, imported when first asked for: it needs Linux, and
    ``import idlekeeper`` must work wherever trio runs (off Linux, asking for one of
    them raises an ImportError that says so). Old names still resolve, with a
    DeprecationWarning."""
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    if name in _MOVED:
        module = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"{__name__}.{name} is deprecated here; import it from {module}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(module), name)
    old = renamed(__name__, name)
    if old is not None:
        return old
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
