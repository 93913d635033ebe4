"""The command-line flags the load tests share, each worded in one place, and a workload's
fields read back from the parsed flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from servers import settings
from servers.extras import version

from .mqtt_versions import protocol_option

__all__ = [
    "add_devices",
    "add_json",
    "add_keepalive",
    "add_protocol",
    "add_quiet",
    "add_rate",
    "add_running_server",
    "add_seed",
    "add_silent",
    "add_targets",
    "add_tick",
    "command_parser",
    "fields_from",
    "program",
    "version_line",
]

NAME = "idlekeeper-loadtest"
"""The console script's name, which ``--version`` gives whichever way the load tester was started."""
MODULE = "python -m loadtest"


def program() -> str:
    """How the operator started the load tester, for usage lines and errors:
    ``python -m loadtest``, or else (the console script ``idlekeeper-loadtest``, or a
    program calling its ``main``) the script's name; as :func:`servers.settings.program`."""
    return settings.program(NAME, MODULE.removeprefix("python -m "))


def version_line() -> str:
    """What ``--version`` prints: ``idlekeeper-loadtest <version>``."""
    return f"{NAME} {version()}"


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A load test's parser, described by the first paragraph of its module's docstring.

    ``prog`` is spelled ``python -m loadtest <command>``; run as the console script, its
    usage and errors name ``idlekeeper-loadtest <command>`` instead. Options must be
    spelled out: a prefix (``--dev``) could silently become another option as options
    are added, and a long load run started with the wrong one costs minutes.
    """
    if prog.startswith(MODULE + " "):
        prog = program() + prog[len(MODULE) :]
    parser = argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0] if doc else None, allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=version_line())
    return parser


def fields_from(args: argparse.Namespace, names: Iterable[str], prefix: str = "") -> dict[str, Any]:
    """The values of the flags ``--<prefix><name>``, keyed by ``name`` (a workload's field)."""
    p = prefix.replace("-", "_")
    return {name: getattr(args, p + name) for name in names}


def add_devices(parser: argparse.ArgumentParser, default: int, help: str = "simulated devices") -> None:
    """``--devices``: how many MQTT devices the generators run."""
    parser.add_argument("--devices", type=int, default=default, help=f"{help} (default: {default:,})")


def add_steady(parser: argparse.ArgumentParser) -> None:
    """``--steady``: seconds of steady state the CPU and RSS figures are read over."""
    parser.add_argument(
        "--steady",
        type=float,
        default=0.0,
        help="seconds of steady state (every device online, nothing happening) over which CPU and RSS "
        "are read, if longer than a keep-alive (default: one keep-alive); a longer window is a steadier "
        "figure on a shared machine",
    )


def add_keepalive(parser: argparse.ArgumentParser, default: int) -> None:
    """``--keepalive``: the devices' MQTT keep-alive."""
    parser.add_argument(
        "--keepalive", type=int, default=default, help=f"device keep-alive K in seconds (default: {default})"
    )


def add_protocol(parser: argparse.ArgumentParser, default: str) -> None:
    """``--protocol``: the MQTT version the devices speak, or a mix (:mod:`loadtest.mqtt_versions`)."""
    parser.add_argument(
        "--protocol",
        type=protocol_option,
        default=default,
        metavar="VERSION|mixed|VERSION:SHARE,...",
        help="the MQTT version of the devices' CONNECT: 3.1, 3.1.1 or 5 for all of them; 'mixed' for half "
        "5.0, half 3.1.1; or shares, the rest 3.1.1: '5:0.5' is half 5.0, '3.1:0.1,5:0.3' is 10%% 3.1, "
        f"30%% 5.0, 60%% 3.1.1 (default: {default})",
    )


def add_silent(parser: argparse.ArgumentParser, default: float) -> None:
    """``--silent``: the share of devices that stop sending with their sockets left open."""
    parser.add_argument(
        "--silent", type=float, default=default, help=f"share of devices that go silent (default: {default})"
    )


def add_rate(parser: argparse.ArgumentParser, default: float) -> None:
    """``--rate``: the devices' connection ramp, over all generators."""
    parser.add_argument("--rate", type=float, default=default, help=f"connections per second (default: {default:,.0f})")


def add_tick(parser: argparse.ArgumentParser, default: float, whose: str) -> None:
    """``--tick``: the keeper tick of the server under test (``whose``: which server's)."""
    parser.add_argument("--tick", type=float, default=default, help=f"{whose} tick in seconds (default: {default:g})")


def add_seed(parser: argparse.ArgumentParser, default: int, help: str = "random seed") -> None:
    """``--seed``: what makes a run's random choices repeatable."""
    parser.add_argument("--seed", type=int, default=default, help=help)


def add_targets(parser: argparse.ArgumentParser, known: Sequence[str], prefix: str = "") -> None:
    """``--<prefix>targets``: the servers to measure, all of ``known`` by default."""
    every = ",".join(known)
    parser.add_argument(f"--{prefix}targets", default=every, help=f"comma-separated (default: {every})")


def add_running_server(parser: argparse.ArgumentParser, *, port_help: str, pid_help: str) -> None:
    """``--port`` and ``--pid``: measure a server someone else started instead of starting one."""
    parser.add_argument("--port", type=int, default=None, help=port_help)
    parser.add_argument("--pid", type=int, action="append", default=[], help=pid_help)


def add_json(
    parser: argparse.ArgumentParser, default: str | None, *, table: bool = False, flag: str = "--json"
) -> None:
    """Where the JSON results go; with ``table``, the Markdown table goes next to them.
    A ``default`` of None writes none unless asked."""
    if table:
        help = "JSON results; the table goes next to it as .md"
    elif default is None:
        help = "write the results as JSON to this file"
    else:
        help = f"JSON results (default: {default})"
    parser.add_argument(flag, default=default, help=help)


def add_quiet(parser: argparse.ArgumentParser, *, live: bool = True) -> None:
    """``--quiet``: no progress output (``live``: a refreshing panel, else a line now and then)."""
    parser.add_argument("--quiet", action="store_true", help="no live progress" if live else "no progress lines")
