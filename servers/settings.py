"""One settings model for a server: each option declared once, with its kind (type,
range and unit), its default, its help and its check.

The command line is built from the declarations (:func:`command_line`), and so is
anything else that sets the same options, such as a configuration file, through
:meth:`Setting.parse`: a value is checked the same way whichever way it came. A value
out of range, unparseable, or naming a file that cannot be read is refused with *one*
line naming the option and what was wrong (:class:`SettingError`), before anything is
bound; argparse's usage block is not printed, nor is a traceback.

Prefix matching is off: argparse would take ``--keepalive 10`` as a prefix of
``--keepalive-over-max``, and ``--worker 2`` as the supervisor's hidden
``--worker-index``. An option is its whole name or nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .extras import version

__all__ = [
    "Choice",
    "CommandLine",
    "Flag",
    "HelpFormatter",
    "Host",
    "Kind",
    "Number",
    "Path",
    "Setting",
    "SettingError",
    "Text",
    "command_line",
    "count",
    "port",
    "program",
    "seconds",
]


class SettingError(ValueError):
    """A value an option cannot take; the message says why, in a phrase."""


class Kind:
    """What values an option takes: parses the text given, or raises :class:`SettingError`."""

    metavar: str | None = None

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for."""
        return text


@dataclass(frozen=True)
class Number(Kind):
    """A number in a range, in a unit.

    ``least`` is inclusive, ``above`` exclusive; ``zero`` (if given) says what 0 means
    where 0 is otherwise out of range ("off", "unbounded"), and lets it through.
    """

    unit: str = ""
    integer: bool = False
    least: float | None = None
    above: float | None = None
    most: float | None = None
    zero: str | None = None
    metavar: str | None = None

    def parse(self, text: str) -> int | float:
        """``text`` as an int or a float, in range."""
        try:
            value: int | float = int(text, 10) if self.integer else float(text)
        except ValueError:
            raise SettingError(f"expected {self.describe()}, not {text!r}") from None
        if not math.isfinite(value):
            raise SettingError(f"expected {self.describe()}, not {text!r}")
        if value == 0 and self.zero is not None:
            return value
        low_ok = (self.least is None or value >= self.least) and (self.above is None or value > self.above)
        if not low_ok or (self.most is not None and value > self.most):
            raise SettingError(f"must be {self.describe()}, not {text}")
        return value

    def describe(self) -> str:
        """The range in words: "a whole number, from 1 to 65535", "a number of seconds, more than 0"..."""
        text = ("a whole number" if self.integer else "a number") + (f" of {self.unit}" if self.unit else "")
        if self.least is not None and self.most is not None:
            text += f", from {self.least:g} to {self.most:g}"
        elif self.above is not None:
            text += f", more than {self.above:g}"
        elif self.least is not None:
            text += f", at least {self.least:g}"
        if self.zero is not None:
            text += f" (0: {self.zero})"
        return text


def seconds(*, least: float | None = None, above: float | None = 0.0, zero: str | None = None) -> Number:
    """A duration in seconds; more than 0 unless told otherwise."""
    if least is not None:
        above = None
    return Number(unit="seconds", least=least, above=above, zero=zero, metavar="SECONDS")


def count(unit: str = "", *, least: int = 1, most: int | None = None) -> Number:
    """A whole number of ``unit`` (bytes, connections...), at least ``least`` (1 by default)."""
    metavar = "BYTES" if unit == "bytes" else "N"
    return Number(unit=unit, integer=True, least=least, most=most, metavar=metavar)


def port(*, zero: str = "any free port") -> Number:
    """A TCP port, 1 to 65535 (and 0: ``zero``)."""
    return Number(integer=True, least=1, most=65535, zero=zero, metavar="PORT")


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few words, in any case."""

    values: tuple[str, ...]

    def parse(self, text: str) -> str:
        """The word, as declared."""
        for value in self.values:
            if text.lower() == value.lower():
                return value
        raise SettingError(f"must be one of {', '.join(self.values)}, not {text!r}")

    @property
    def metavar(self) -> str:  # type: ignore[override]
        return "{" + ",".join(self.values) + "}"


@dataclass(frozen=True)
class Text(Kind):
    """Free text, checked by ``check`` (which raises ValueError with the reason)."""

    check: Callable[[str], Any] | None = None
    metavar: str | None = None

    def parse(self, text: str) -> Any:
        """``check(text)``, or the text itself."""
        if self.check is None:
            return text
        try:
            return self.check(text)
        except ValueError as exc:
            raise SettingError(str(exc)) from None


@dataclass(frozen=True)
class Path(Kind):
    """A file the server reads (``mode="read"``: it must exist and be readable) or
    appends to (``"append"``: its folder must exist and it must be writable; ``-`` is
    stdout), checked when the option is parsed, not at the first use."""

    mode: str = "read"
    metavar: str | None = "FILE"

    def parse(self, text: str) -> str:
        """The path, once it is known to open."""
        if not text:
            raise SettingError("needs a file name")
        if self.mode == "append" and text == "-":
            return text
        if os.path.isdir(text):
            raise SettingError(f"{text} is a directory, not a file")
        try:
            # Opened and closed at once: the server opens it again when it starts.
            with open(text, "rb" if self.mode == "read" else "ab"):
                pass
        except OSError as exc:
            raise SettingError(f"cannot {'read' if self.mode == 'read' else 'write'} {text}: {exc.strerror}") from None
        return text


@dataclass(frozen=True)
class Host(Kind):
    """A name or address to listen on; it must resolve here."""

    metavar: str | None = "HOST"

    def parse(self, text: str) -> str:
        """The host, once it resolves."""
        try:
            socket.getaddrinfo(text, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError) as exc:
            reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
            raise SettingError(f"cannot resolve {text} ({reason})") from None
        return text


@dataclass(frozen=True)
class Flag(Kind):
    """On when given, off otherwise (no value)."""

    def parse(self, text: str) -> bool:
        """A flag's value written out (a configuration file's ``true`` or ``false``)."""
        lowered = text.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise SettingError(f"must be true or false, not {text!r}")


@dataclass(frozen=True)
class Setting:
    """One option: its name, kind, default and help, declared once."""

    option: str
    kind: Kind
    default: Any
    help: str
    group: str | None = None
    """The --help section it is listed under (None: the main one)."""
    hidden: bool = False
    """Set by the server itself (the supervisor's ``--worker-index``), not by an operator."""
    metavar: str | None = None
    """How --help writes its value (the kind's word by default)."""
    many: bool = False
    """Given any number of times; the value is the list of them (None: never given)."""
    aliases: tuple[str, ...] = ()
    """Other spellings of the option (``-c`` for ``--config``)."""
    dest: str = field(default="")

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.option.lstrip("-").replace("-", "_"))

    def parse(self, text: str) -> Any:
        """``text`` as this option's value; :class:`SettingError` naming the option if it cannot be."""
        try:
            return self.kind.parse(text)
        except SettingError as exc:
            raise SettingError(f"{self.option}: {exc}") from None


class HelpFormatter(argparse.HelpFormatter):
    """argparse's own, but a word is never cut: a URL form such as
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE`` stays on one line, to be copied."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


class CommandLine(argparse.ArgumentParser):
    """A server's command line: no prefix matching, and an error is one line on stderr
    naming the option, then exit 2 (argparse's usage block buries the reason)."""

    def __init__(self, settings: Iterable[Setting] = (), **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(allow_abbrev=False, **kwargs)
        self.settings: dict[str, Setting] = {}
        self.add_argument("--version", action="version", version=f"{self.prog} {version()}")
        self.add_settings(settings)

    def add_settings(self, settings: Iterable[Setting]) -> None:
        """Declare ``settings`` on this command line, each in its --help section."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for setting in settings:
            self.settings[setting.option] = setting
            where: argparse.ArgumentParser | argparse._ArgumentGroup = self
            if setting.group is not None:
                if setting.group not in groups:
                    groups[setting.group] = self.add_argument_group(setting.group)
                where = groups[setting.group]
            text = argparse.SUPPRESS if setting.hidden else setting.help
            names = (setting.option, *setting.aliases)
            if isinstance(setting.kind, Flag):
                where.add_argument(*names, dest=setting.dest, action="store_true", help=text)
                continue
            where.add_argument(
                *names,
                dest=setting.dest,
                action="append" if setting.many else "store",
                type=_argparse_type(setting),
                default=setting.default,
                metavar=setting.metavar or setting.kind.metavar,
                help=text,
            )

    def error(self, message: str) -> NoReturn:
        """One line, ``PROG: error: WHAT``, and exit 2."""
        self.exit(2, f"{self.prog}: error: {message.removeprefix('argument ')}\n")

    def refuse(self, option: str, reason: str) -> NoReturn:
        """Refuse ``option`` (one that parsed, but does not go with the others) in one line."""
        self.error(f"{option}: {reason}")


def _argparse_type(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return setting.kind.parse(text)
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.dest  # argparse names a type in some of its messages
    return parse


def command_line(script: str, module: str, description: str, settings: Sequence[Setting]) -> CommandLine:
    """The command line of ``script`` (also run as ``python -m module``), from its settings."""
    return CommandLine(settings, prog=program(script, module), description=description)


def program(script: str, module: str) -> str:
    """How the operator ran the command: ``python -m module``, or else (the console script,
    or a program that calls its ``main``) the script's name."""
    ran = sys.argv[0].replace(os.sep, "/")
    path = module.replace(".", "/")
    return f"python -m {module}" if ran.endswith((f"/{path}/__main__.py", f"/{path}.py")) else script
