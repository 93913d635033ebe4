"""The settings every server worker has, whatever protocol it speaks."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any, TypeVar

from .settings import Choice, Host, Path, Setting, Text, count, seconds
from .settings import port as port_kind
from .tls import TLSOptions, tls_options

__all__ = [
    "LOG_FILE",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "LOG_LEVELS",
    "WorkerConfig",
    "configure_logging",
    "worker_settings",
]


C = TypeVar("C", bound="WorkerConfig")


@dataclass
class WorkerConfig:
    """Where a worker listens, how fine its keeper's tick is, and which worker it is.

    Each server's own configuration extends it (``HeartbeatConfig``, ``HttpConfig``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    tick: float = 0.1
    """The keeper's tick: no expiry runs more than this late."""
    lookahead: float | None = None
    """How far ahead the reaper visits when it wakes (None: the keeper's default)."""
    worker: int = 0
    """This worker's index among those sharing the port (0 for a lone server)."""
    tls: TLSOptions | None = None
    """Serve TLS with these settings (None: plain TCP); see :mod:`servers.tls`."""

    @classmethod
    def from_args(cls: type[C], args: argparse.Namespace, worker: int, **own: Any) -> C:
        """A worker's configuration: the shared settings from a command line parsed
        with :func:`worker_settings` (and :func:`~servers.tls.tls_settings`),
        and the server's ``own`` settings."""
        return cls(
            host=args.host,
            port=args.port,
            tick=args.tick,
            lookahead=args.lookahead,
            worker=worker,
            tls=tls_options(args),
            **own,
        )


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
"""Every server's log line: the time (to the millisecond), the logger, the level.
``loadtest fuzz`` reads the time to match a fault with the inputs then in flight."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

LOG_LEVEL = Setting(
    "--log-level",
    Choice(LOG_LEVELS),
    "WARNING",
    "logging level for protocol errors and the like (default: WARNING)",
)
"""``--log-level``: one of :data:`LOG_LEVELS`, in any case."""


LOG_FILE = Setting(
    "--log-file",
    Path("append"),
    None,
    "append the log to this file instead of stderr, or - for stdout (Mosquitto's log_dest file; "
    "each worker appends its own lines) (default: stderr)",
)
"""``--log-file``: where :func:`configure_logging` writes, if not stderr."""


def configure_logging(level: str, file: str | None = None) -> None:
    """Log at ``level`` (a name: ``info``, ``WARNING``...), in :data:`LOG_FORMAT`, to
    stderr, or to ``file`` (appended; ``-``: stdout)."""
    if file is None:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    elif file == "-":
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stdout)
    else:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT, filename=file, encoding="utf-8")


def worker_settings(*, port: int, tick_help: str = "") -> tuple[Setting, ...]:
    """``--host``, ``--port``, ``--workers``, ``--tick``, ``--lookahead``, ``--pid-file``
    and the supervisor's hidden ``--worker-index``: what every server's command line has."""
    return (
        Setting("--host", Host(), "127.0.0.1", "address to listen on (default: 127.0.0.1; 0.0.0.0 for all)"),
        Setting("--port", port_kind(), port, f"TCP port; 0 picks a free one (default: {port})"),
        Setting(
            "--workers",
            count(least=1),
            1,
            "worker processes sharing the port with SO_REUSEPORT (default: 1)",
        ),
        Setting(
            "--tick",
            seconds(),
            0.1,
            f"keeper tick in seconds: expiries run at most this late{tick_help} (default: 0.1)",
        ),
        Setting(
            "--lookahead",
            seconds(least=0),
            None,
            "seconds ahead the keeper's reaper visits when it wakes, so that re-filing live"
            " connections costs a wake-up a lookahead rather than one a tick; 0 visits each at its"
            " own tick (default: the larger of 1 s and the tick)",
        ),
        Setting(
            "--pid-file",
            Text(_file_name, metavar="FILE"),
            None,
            "write the server's PID (the supervisor's, with --workers) to FILE at start, and remove it"
            " at exit; not needed under systemd (default: none)",
        ),
        Setting("--worker-index", count(least=0), None, "", hidden=True),
    )


def _file_name(text: str) -> str:
    # Written by the runner once the port is known to be free (a taken port must not
    # cost a running server its file); a file it cannot write is refused then.
    if not text:
        raise ValueError("needs a file name")
    return text
