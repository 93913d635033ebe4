"""What each command needs installed, and the one line that says so when it is not.

The distribution's library (:mod:`idlekeeper`) needs trio alone; the servers and the
load tester bring their own packages with pip's extras (``pip install
'idlekeeper[servers]'``). A command started without its extra would die on its first
``import`` with a traceback naming a module the operator never asked for; each command
calls :func:`require` before importing anything heavy, and says which extra to install.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["EXTRAS", "MissingExtra", "missing", "require", "version"]

EXTRAS: dict[str, tuple[str, ...]] = {
    # The import names of what each extra of pyproject.toml installs (which must match).
    "servers": ("h11", "psutil", "prometheus_client", "coredis", "wsproto"),
    "loadtest": ("h11", "psutil", "prometheus_client", "coredis", "wsproto", "rich", "matplotlib", "trustme"),
}


class MissingExtra(SystemExit):
    """A command's extra is not installed; exits 2 with the one line that says which."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(command: str, extra: str, *, also: Sequence[str] = ()) -> None:
    """Exit 2 with one line on stderr unless everything ``extra`` (and ``also``) installs is here."""
    absent = missing(extra) + [name for name in also if importlib.util.find_spec(name) is None]
    if absent:
        line = (
            f"{command}: needs the '{extra}' extra (missing: {', '.join(absent)}): "
            f"pip install 'idlekeeper[{extra}]'"
        )
        print(line, file=sys.stderr)
        raise MissingExtra(line)


def version() -> str:
    """The installed distribution's version (the checkout's pyproject.toml before an install)."""
    from importlib import metadata

    try:
        return metadata.version("idlekeeper")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout never installed
        return "0+unknown"
