"""The code's layout, held (issue 60): no import circle among the modules of
``idlekeeper``, ``servers``, ``loadtest`` and ``benchmarks`` (an import made only for
the type checker counts too: it is still a circle to read); the heartbeat server's
rooms import only downward; no file past the size one can read whole; and what a
newcomer reads first, the commands' help, says every form an option takes, unbroken."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("idlekeeper", "servers", "loadtest", "benchmarks")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``found`` it imports (``from x import y`` counts ``x.y``
    when that is a module, else ``x``)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                named = {f"{target}.{alias.name}" for alias in node.names} & found.keys()
                graph[name] |= (named or ({target} & found.keys())) - {name}
            elif isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names} & found.keys()
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in list(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_no_module_imports_in_a_circle() -> None:
    assert circles(imports(modules())) == []


def test_the_circle_finder_finds_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


HEARTBEAT = "servers.heartbeat"
RANKS: tuple[tuple[str, ...], ...] = (
    ("mqtt",),
    ("presence", "broker", "security"),
    ("coordination", "listener", "bridge"),
    ("config",),
    ("settings", "server"),
    ("transports",),
    ("bridging",),
    ("worker", "conf"),
    ("auth", "__main__"),
    ("",),
)
"""The heartbeat server's rooms, lowest first (the package's own docstring draws them):
a module may import from its own room or a lower rank, never upward, and never from
another room of its own rank, so the rooms of one rank stay apart. ``""`` is the
package itself, the front door."""
LONGEST = 500
"""Lines a module of the packages may have (tests aside): one job, read in one sitting."""


def room(module: str) -> str:
    """The heartbeat room ``module`` sits in (its first name below the package)."""
    return module.removeprefix(HEARTBEAT).lstrip(".").partition(".")[0]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of the heartbeat package that goes to a higher room or a sibling one."""
    rank = {name: level for level, names in enumerate(RANKS) for name in names}
    out = []
    for module, targets in graph.items():
        if module != HEARTBEAT and not module.startswith(HEARTBEAT + "."):
            continue
        here = room(module)
        for target in sorted(targets):
            if target != HEARTBEAT and not target.startswith(HEARTBEAT + "."):
                continue
            there = room(target)
            if there != here and rank[there] >= rank[here]:
                out.append((module, target))
    return out


def test_every_heartbeat_module_sits_in_a_ranked_room() -> None:
    rank = {name for names in RANKS for name in names}
    assert sorted({room(m) for m in modules() if m.startswith(HEARTBEAT)} - rank) == []


def test_the_heartbeat_rooms_import_only_downward() -> None:
    assert upward(imports(modules())) == []


def test_the_downward_check_finds_an_import_upward_and_one_across() -> None:
    graph = {
        "servers.heartbeat.mqtt.session": {"servers.heartbeat.mqtt.packets", "servers.heartbeat.server.connection"},
        "servers.heartbeat.broker.routing": {"servers.heartbeat.mqtt.filters", "servers.heartbeat.presence.event"},
        "servers.heartbeat.server.fanout": {"servers.heartbeat.broker.routing", "servers.heartbeat.config"},
    }
    assert upward(graph) == [
        ("servers.heartbeat.mqtt.session", "servers.heartbeat.server.connection"),
        ("servers.heartbeat.broker.routing", "servers.heartbeat.presence.event"),
    ]


def test_no_module_is_longer_than_one_can_read_whole() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > LONGEST}
    assert long == {}


def test_every_form_of_the_cluster_url_is_in_the_help_unbroken() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "servers.heartbeat", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for form in (
        "redis://HOST:PORT/DB",
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]",
        "redis+cluster://HOST:PORT[,HOST:PORT...][/?shards=N]",
    ):
        assert form in text, form
