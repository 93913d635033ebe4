"""Reference pages generated from the code at build time, so they never go stale.

``.. command-options:: module:function`` renders every option of a command from its
real :mod:`argparse` parser. ``function`` is either a ``parser()`` that returns the
parser, or (with the ``:main:`` flag) the command's ``main(argv)``, which builds its
parser inline: it is called with ``parse_args`` intercepted, so nothing runs.

A ```` ```python-fragment ```` block is shown as Python and never run by
``tests/test_docs_examples.py``.

``.. metrics-table:: <source>`` renders the Prometheus families one source exports
(name, type, labels, help), read from the real collectors: a heartbeat worker and an
HTTP server started in-process on a free loopback port, the keeper's collector, and
the figures of the two coordinators that need peers (the supervisor's link and the
Redis fleet), built over idle stand-ins of those peers.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterator
from functools import cache, partial
from types import SimpleNamespace
from typing import Any, NoReturn

import trio
from docutils import nodes
from docutils.parsers.rst import directives
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pygments.lexers.python import PythonLexer  # type: ignore[import-untyped]
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

__all__ = ["setup"]


# -- commands -------------------------------------------------------------------------


class _Captured(Exception):
    """Raised in place of parsing: carries the parser a ``main`` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
    raise _Captured(self)


def command_parser(target: str, from_main: bool) -> argparse.ArgumentParser:
    """The parser of ``module:function``: returned by it, or built by a ``main``."""
    module_name, _, name = target.partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module_name), name)
    if not from_main:
        parser = function()
        assert isinstance(parser, argparse.ArgumentParser), target
        return parser
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = _capture  # type: ignore[method-assign]
    try:
        function([])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{target} returned without parsing its arguments")


def _option_term(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or (action.metavar if isinstance(action.metavar, str) else action.dest)
    if action.option_strings and action.nargs != 0:
        if action.choices is not None:
            names += " {" + ",".join(str(c) for c in action.choices) + "}"
        elif isinstance(action.metavar, str):
            names += " " + action.metavar
        else:
            names += " " + action.dest.upper()
    return names


def _option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        text = ""
    else:
        formatter = parser._get_formatter()
        text = formatter._expand_help(action)
    default = action.default
    shown = default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
    if shown and "default" not in text.lower():
        text += f" (default: {default})"
    return text


def _options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            yield group.title or "options", actions


class CommandOptions(SphinxDirective):
    """Every option of one command, from its parser."""

    required_arguments = 1
    option_spec = {"main": directives.flag}  # noqa: RUF012 (docutils' own class attribute)

    def run(self) -> list[nodes.Node]:
        parser = command_parser(self.arguments[0], "main" in self.options)
        return self._render(parser)

    def _render(self, parser: argparse.ArgumentParser) -> list[nodes.Node]:
        out: list[nodes.Node] = [nodes.literal_block(text=parser.format_usage().strip())]
        if parser.description:
            out.append(nodes.paragraph(text=" ".join(parser.description.split())))
        subcommands: list[tuple[str, argparse.ArgumentParser]] = []
        for title, actions in _options(parser):
            items = nodes.definition_list()
            for action in actions:
                if isinstance(action, argparse._SubParsersAction):
                    subcommands.extend(action.choices.items())
                    continue
                term = nodes.term("", "", nodes.literal(text=_option_term(action)))
                definition = nodes.definition("", nodes.paragraph(text=_option_help(parser, action)))
                items += nodes.definition_list_item("", term, definition)
            if len(items):
                out.append(nodes.rubric(text=title.capitalize()))
                out.append(items)
        for name, sub in subcommands:
            out.append(nodes.rubric(text=f"{parser.prog} {name}"))
            out.extend(self._render(sub))
        return out


# -- metrics --------------------------------------------------------------------------


def _families(text: bytes) -> list[Metric]:
    return list(text_string_to_metric_families(text.decode()))


async def _heartbeat_exposition() -> bytes:
    from servers.heartbeat.config import HeartbeatConfig
    from servers.heartbeat.security.passwords import PasswordFile
    from servers.heartbeat.worker import serve_heartbeat

    config = HeartbeatConfig(port=0, auth=PasswordFile())  # a password file: the auth_* figures too
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, config))
        text: bytes = server.metrics()
        nursery.cancel_scope.cancel()
    return text


@cache
def _http_text() -> bytes:
    return trio.run(_http_exposition)


async def _http_exposition() -> bytes:
    from servers.http.asgi import native_asgi
    from servers.http.builtin import builtin_app
    from servers.http.server import HttpConfig, serve_asgi
    from servers.prometheus import render, worker_registry

    async with trio.open_nursery() as nursery:
        serve = partial(serve_asgi, native_asgi(builtin_app()), HttpConfig(port=0), lifespan=False)
        server = await nursery.start(serve)
        registry = worker_registry(server.keeper.stats, {"worker": "0"}, server.figures)
        text = render(registry)
        nursery.cancel_scope.cancel()
    return text


def _bus_families() -> list[Metric]:
    from servers.heartbeat.coordination.local import BusCoordinator

    idle = SimpleNamespace(worker=0, connected=False, _unacked=[], reconnects=0, resent=0, routed=0, routed_unkept=0)
    return BusCoordinator.figures(idle)  # type: ignore[arg-type]


def _durable_families() -> list[Metric]:
    import tempfile
    import time

    from servers.heartbeat.broker.persistent import SessionStore
    from servers.heartbeat.coordination.durable import Durability
    from servers.heartbeat.coordination.durable.driver import durability_figures
    from servers.heartbeat.coordination.registry import Registry
    from servers.heartbeat.coordination.retention import Retention

    with tempfile.TemporaryDirectory() as folder:
        durability = Durability(f"{folder}/state.db", store_clock=time.time)
        retention = Retention(Registry(), presence_prefix="$SYS/presence/", clock=time.time)
        families = durability_figures(durability, SessionStore(), retention)
        durability.close(clean=True)
    return families


def _fleet_families() -> list[Metric]:
    from servers.heartbeat.coordination.fleet.metrics import FleetCounts, fleet_families

    link = SimpleNamespace(rtt_last=0.0, rtt_avg=0.0, connected=False)
    return fleet_families(FleetCounts(), link, queued=0, members=0, persistent_filters=0)  # type: ignore[arg-type]


@cache
def metric_source(name: str) -> tuple[Metric, ...]:
    """The families one source exports, by name."""
    if name == "heartbeat":
        found = _families(trio.run(_heartbeat_exposition))
        return tuple(m for m in found if not m.name.startswith(("idlekeeper_", "process_")))
    if name in ("keeper", "process"):
        found = _families(_http_text())
        prefix = "idlekeeper_" if name == "keeper" else "process_"
        return tuple(m for m in found if m.name.startswith(prefix))
    if name == "http":
        found = _families(_http_text())
        return tuple(m for m in found if m.name.startswith("http_"))
    if name == "bus":
        return tuple(_bus_families())
    if name == "fleet":
        return tuple(_fleet_families())
    if name == "durable":
        return tuple(_durable_families())
    raise ValueError(f"unknown metrics source {name!r}")


def _exposed_name(metric: Metric) -> str:
    return metric.name + "_total" if metric.type == "counter" else metric.name


def _labels(metric: Metric) -> str:
    names: set[str] = set()
    for sample in metric.samples:
        names.update(sample.labels)
    names.discard("le")
    return ", ".join(sorted(names))


class MetricsTable(SphinxDirective):
    """A table of the families one source exports: name, type, labels, help."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        families = metric_source(self.arguments[0])
        table = nodes.table()
        group = nodes.tgroup(cols=4)
        table += group
        for width in (30, 8, 12, 50):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(nodes.Text("Metric"), nodes.Text("Type"), nodes.Text("Labels"), nodes.Text("Help"))
        body = nodes.tbody()
        group += body
        for metric in families:
            body += self._row(
                nodes.literal(text=_exposed_name(metric)),
                nodes.Text(metric.type),
                nodes.Text(_labels(metric)),
                nodes.Text(metric.documentation),
            )
        return [table]

    @staticmethod
    def _row(*cells: nodes.Node) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", cell)
            row += entry
        return row


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directives."""
    app.add_directive("command-options", CommandOptions)
    app.add_directive("metrics-table", MetricsTable)
    # ```python-fragment: shown as Python, never run by tests/test_docs_examples.py.
    app.add_lexer("python-fragment", PythonLexer)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
