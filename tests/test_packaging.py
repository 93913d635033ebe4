"""What the library asks of an installation: trio alone; the pure parts not even that."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import idlekeeper

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter whose import system refuses the named packages, then
# import every module of idlekeeper: a stray import of one of them fails here.
_PROBE = """
import importlib, importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed (blocked by the test)")
        return None
sys.meta_path.insert(0, Refuse())
if len(sys.argv) > 3:
    # Stand the package up without running its __init__ (which imports the keeper,
    # and so trio), to test the pure modules on their own.
    import types
    package = types.ModuleType("idlekeeper")
    package.__path__ = [sys.argv[3]]
    sys.modules["idlekeeper"] = package
for module in sys.argv[2].split(","):
    importlib.import_module(module)
print("ok")
"""


def _imports_without(
    blocked: list[str], modules: list[str], *, bare_package: bool = False
) -> subprocess.CompletedProcess[str]:
    bare = [str(ROOT / "idlekeeper")] if bare_package else []
    return subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(blocked), ",".join(modules), *bare],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def _library_modules() -> list[str]:
    return ["idlekeeper"] + [f"idlekeeper.{m.name}" for m in pkgutil.iter_modules(idlekeeper.__path__)]


def _name(requirement: str) -> str:
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop)[0]
    return requirement.lower().replace("_", "-")


def test_library_depends_on_trio_alone() -> None:
    """The installed distribution's metadata: trio unconditionally, the rest in extras."""
    requires = metadata.requires("idlekeeper") or []
    always = [_name(r) for r in requires if "extra ==" not in r]
    assert always == ["trio"]
    servers = {_name(r) for r in requires if 'extra == "servers"' in r}
    assert {"h11", "psutil", "prometheus-client"} <= servers


def test_library_imports_without_the_servers_dependencies() -> None:
    done = _imports_without(["h11", "psutil", "prometheus_client"], _library_modules())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_probe_can_fail() -> None:
    """The blocking import hook is real: a module that needs h11 fails under it."""
    done = _imports_without(["h11"], ["servers.http.server"])
    assert done.returncode != 0
    assert "blocked by the test" in done.stderr


def test_wheel_timers_and_epochs_import_without_trio() -> None:
    """The pure data structures stand alone: no trio, the clock passed in."""
    pure = ["idlekeeper.wheel", "idlekeeper.timers", "idlekeeper.epochs", "idlekeeper.deadlines", "idlekeeper.stats"]
    done = _imports_without(["trio"], pure, bare_package=True)
    assert done.returncode == 0, done.stderr
    # ...while the keeper itself does need it (so the block above is doing its job).
    assert _imports_without(["trio"], ["idlekeeper.keeper"], bare_package=True).returncode != 0
