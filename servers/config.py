"""The settings every server worker has, whatever protocol it speaks."""

from __future__ import annotations

import argparse
import logging
import textwrap
from dataclasses import dataclass
from typing import Any, TypeVar

from .tls import TLSOptions, tls_options

__all__ = ["LOG_FORMAT", "HelpFormatter", "WorkerConfig", "add_log_level", "add_worker_arguments", "configure_logging"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's own, but a word is never cut: a URL form such as
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE`` stays on one line, to be copied."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


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
        with :func:`add_worker_arguments` (and :func:`~servers.tls.add_tls_arguments`),
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


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-level`` to a server's command line."""
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level for protocol errors and the like (default: WARNING)"
    )


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (a name: ``info``, ``WARNING``...), in :data:`LOG_FORMAT`."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def add_worker_arguments(parser: argparse.ArgumentParser, *, port: int, tick_help: str = "") -> None:
    """Add ``--host``, ``--port``, ``--workers``, ``--tick`` and the supervisor's
    hidden ``--worker-index`` to a server's command line."""
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    a("--port", type=int, default=port, help=f"TCP port; 0 picks a free one (default: {port})")
    a("--workers", type=int, default=1, help="worker processes sharing the port with SO_REUSEPORT (default: 1)")
    a(
        "--tick",
        type=float,
        default=0.1,
        help=f"keeper tick in seconds: expiries run at most this late{tick_help} (default: 0.1)",
    )
    a(
        "--lookahead",
        type=float,
        default=None,
        help="seconds ahead the keeper's reaper visits when it wakes, so that re-filing live"
        " connections costs a wake-up a lookahead rather than one a tick; 0 visits each at its"
        " own tick (default: the larger of 1 s and the tick)",
    )
    a("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
