"""What pip installs matches what each command imports (issue 61): pyproject.toml's
extras and scripts against :data:`servers.extras.EXTRAS` and the code itself."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from servers.extras import EXTRAS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Distribution names whose import name differs.
IMPORT_NAME = {"prometheus-client": "prometheus_client"}
# Imported by our code but brought by trio (the 3.10 backport) or read only by type checkers.
NOT_OURS_TO_LIST = {"trio", "exceptiongroup", "typing_extensions"}


def _requirements(extra: str) -> set[str]:
    """The import names an extra installs, its own ``idlekeeper[...]`` extras included."""
    names: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        if requirement.startswith("idlekeeper["):
            names |= _requirements(requirement[len("idlekeeper[") : -1])
            continue
        dist = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]
        names.add(IMPORT_NAME.get(dist, dist.replace("-", "_")))
    return names


def _third_party_imports(package: str) -> dict[str, str]:
    """Every module outside the standard library and ours that ``package`` imports: where first."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ("servers", "idlekeeper", "loadtest"):
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_installs_what_its_command_checks_for(extra: str) -> None:
    assert _requirements(extra) == set(EXTRAS[extra])


def test_the_servers_import_nothing_their_extra_leaves_out() -> None:
    imported = _third_party_imports("servers")
    assert {name: where for name, where in imported.items() if name not in EXTRAS["servers"]} == {
        name: where for name, where in imported.items() if name in NOT_OURS_TO_LIST
    }


def test_the_library_needs_trio_alone() -> None:
    assert PROJECT["dependencies"] == ["trio>=0.25"]
    assert set(_third_party_imports("idlekeeper")) - NOT_OURS_TO_LIST == set()


def test_every_console_script_is_a_main_taking_argv() -> None:
    scripts = PROJECT["scripts"]
    assert set(scripts) == {"idlekeeper-heartbeat", "idlekeeper-http", "idlekeeper-passwd", "idlekeeper-loadtest"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        main = getattr(importlib.import_module(module), name)
        assert callable(main)
        assert list(main.__code__.co_varnames[: main.__code__.co_argcount]) == ["argv"], target
