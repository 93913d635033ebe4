"""A reader of Mosquitto's configuration format (mosquitto.conf(5)), which knows
nothing of what the directives mean: the lines of a file as directives, each with the
file and line it came from and the section it is in.

The format, as Mosquitto 2.0 reads it:

- one directive a line, ``NAME VALUE...``; blank lines and lines starting with ``#``
  are skipped (leading blanks are allowed before either, where Mosquitto itself would
  choke on ``  # ...``: a lenient reader loses nothing);
- ``include_dir DIR`` reads every ``*.conf`` file of ``DIR`` in place, in the order
  Mosquitto sorts them (by name, ignoring case first, then upper case before lower
  case); only the main file's ``include_dir`` counts, an included file's is ignored,
  as Mosquitto does (the caller is told in a warning);
- some directives begin a section (``listener PORT [ADDRESS]``) that runs to the next
  one *in the same file*: an included file starts outside any section, as in
  Mosquitto, whose current listener is a file's own;
- a bridge's ``connection NAME`` begins a section of another kind, which runs beside
  the listener's: Mosquitto keeps its current bridge and its current listener apart, so
  a listener's line below a ``connection`` is still its listener's, and a bridge's
  line below a ``listener`` still its bridge's (to the next ``connection``, in the
  same file).

What a file cannot be read, or a line cannot be, is a :class:`ConfigError` whose
message is one line, ``FILE:LINE: DIRECTIVE: reason``.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["ConfigError", "Directive", "Parsed", "include_order", "read_config"]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message is one line naming the
    file, the line and the directive where there is one, and why."""


@dataclass(frozen=True)
class Directive:
    """One line of a configuration file: ``name`` and the rest of the line, ``value``."""

    name: str
    value: str
    """The rest of the line, blanks trimmed at both ends ("" when there is none)."""
    file: str
    line: int
    section: Directive | None = None
    """The directive that began the listener section this one is in (None: the file's global part)."""
    bridge: Directive | None = None
    """The ``connection`` directive that began the bridge section this one is in (None: none)."""

    @property
    def where(self) -> str:
        """``FILE:LINE``."""
        return f"{self.file}:{self.line}"

    @property
    def words(self) -> list[str]:
        """The value split at blanks."""
        return self.value.split()

    def error(self, reason: str) -> ConfigError:
        """``FILE:LINE: NAME: reason``, to raise."""
        return ConfigError(f"{self.where}: {self.name}: {reason}")


@dataclass
class Parsed:
    """Every directive of a file and of the files it includes, in the order read."""

    directives: list[Directive] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Lines read but not used, each saying where and why (one line each)."""
    files: list[str] = field(default_factory=list)
    """The files read, the main one first."""


def read_config(
    path: str, *, sections: Collection[str] = ("listener",), bridges: Collection[str] = ("connection",)
) -> Parsed:
    """The directives of the file at ``path`` (and of the ``include_dir`` files), each in
    the section begun by the last of ``sections`` above it in its own file, and in the
    bridge section begun by the last of ``bridges``."""
    parsed = Parsed()
    _read(path, parsed, (sections, bridges), top=True)
    return parsed


def include_order(names: Collection[str]) -> list[str]:
    """``names`` in the order Mosquitto reads an ``include_dir``: character by character,
    ignoring case first; where two names differ only in case, the upper case first
    (C's ``toupper`` compare, then the plain one)."""
    return sorted(names, key=lambda name: [(ord(c.upper()) if c.isascii() else ord(c), ord(c)) for c in name])


_Kinds = tuple[Collection[str], Collection[str]]


def _read(path: str, parsed: Parsed, kinds: _Kinds, *, top: bool, origin: Directive | None = None) -> None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        reason = f"cannot read {path}: {exc.strerror}"
        raise (origin.error(reason) if origin is not None else ConfigError(reason)) from None
    parsed.files.append(path)
    sections, bridges = kinds
    section: Directive | None = None
    bridge: Directive | None = None
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        try:
            line = line_bytes.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{path}:{number}: not UTF-8 text") from None
        if not line or line.startswith("#"):
            continue
        words = line.split(None, 1)
        name = words[0]
        rest = words[1].strip() if len(words) > 1 else ""
        directive = Directive(name, rest, path, number, section, bridge)
        if name == "include_dir":
            if not top:
                # Mosquitto reads include_dir in the main file only, and says nothing.
                parsed.warnings.append(f"{directive.where}: include_dir: ignored: only the main file's is read")
                continue
            for included in _included(directive):
                _read(included, parsed, kinds, top=False, origin=directive)
            continue
        if name in sections or name in bridges:
            directive = Directive(name, rest, path, number)
            if name in sections:
                section = directive
            else:
                bridge = directive
        parsed.directives.append(directive)


def _included(directive: Directive) -> list[str]:
    folder = directive.value
    if not folder:
        raise directive.error("needs a directory")
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.name.endswith(".conf") and len(entry.name) > 5]
    except OSError as exc:
        raise directive.error(f"cannot open {folder}: {exc.strerror}") from None
    return [os.path.join(folder, name) for name in include_order(names)]
