"""Turns a Mosquitto configuration file into the heartbeat server's command-line
arguments (:func:`expand_config`), checking each directive's value as its option
would be; see the package's docstring for the rules."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...conffile import ConfigError, Directive, read_config
from ...config import LOG_FILE
from ...settings import Flag, Host, Path, Setting, SettingError, Text
from ..listener import LISTENER_KEYS, SECURITY_KEYS, ListenerSpec
from ..settings import SETTINGS
from .bridges import bridge_argument
from .directives import (
    BRIDGE_DIRECTIVES,
    DEFAULT_LISTENER,
    DEFAULT_VALUES,
    DIRECTIVES,
    EXPIRY_UNITS,
    IGNORED,
    LOG_LEVELS,
    MOSQUITTO_DB_MAGIC,
    PERSISTENCE_FILE,
    PLUGINS,
    REFUSED,
    SECURITY_OPTIONS,
    UNBOUNDED_AT_ZERO,
    VERBOSITY,
    nearest,
)

__all__ = ["config_file", "expand_config", "translate"]


def config_file(argv: Sequence[str]) -> str | None:
    """The file of the last ``-c FILE``, ``-cFILE``, ``--config FILE`` or ``--config=FILE``
    in ``argv`` (None: none, or one without its file, which argparse then refuses)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg in ("-c", "--config"):
            found = argv[i + 1] if i + 1 < len(argv) else None
        elif arg.startswith("--config="):
            found = arg.partition("=")[2]
        elif arg.startswith("-c") and not arg.startswith("--"):
            found = arg[2:]
    return found


def expand_config(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with the arguments its ``-c FILE`` stands for put first, and the warnings
    (one line each) of the directives ignored; ``argv`` itself when it names no file.
    Raises :class:`~servers.conffile.ConfigError` saying what cannot be used, in one line."""
    path = config_file(argv)
    if path is None:
        return list(argv), []
    if not os.access(path, os.R_OK) or os.path.isdir(path):
        # The file itself, before its lines: the one line names the option that gave it.
        reason = "is a directory" if os.path.isdir(path) else "cannot be read (missing, or no permission)"
        raise ConfigError(f"--config: {path} {reason}")
    arguments, warnings = translate(path, _options_given(argv))
    return arguments + list(argv), warnings


def _options_given(argv: Sequence[str]) -> set[str]:
    given = set()
    for arg in argv:
        if arg == "--":
            break
        if arg.startswith("--"):
            given.add(arg.partition("=")[0])
    return given


def translate(path: str, given: set[str] | frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """The command-line arguments the file at ``path`` stands for, leaving out the options
    in ``given`` (the command line's own), and the warnings."""
    parsed = read_config(path)
    translation = _Translation(given, parsed.directives)
    translation.warnings += parsed.warnings
    for directive in parsed.directives:
        translation.take(directive)
    translation.finish()
    return translation.arguments, translation.warnings


@dataclass
class _Listener:
    header: Directive
    port: int
    address: str
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Translation:
    """The arguments, as the directives are taken one by one, then :meth:`finish`."""

    given: set[str] | frozenset[str]
    directives: list[Directive] = field(default_factory=list)
    """The whole file's (a bridge's section is read whole at its first line)."""
    arguments: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    per_listener: bool = False
    security_seen: bool = False
    anonymous_given: bool = False
    default_listener: bool = False
    """A ``port`` or ``bind_address`` line: Mosquitto's default listener, which is not local only."""
    listeners: list[_Listener] = field(default_factory=list)
    sections: dict[Directive, _Listener] = field(default_factory=dict)
    global_security: list[Directive] = field(default_factory=list)
    """Security directives outside any listener under ``per_listener_settings true``."""
    persistence: Directive | None = None
    persistence_location: Directive | None = None
    persistence_file: Directive | None = None
    log_types: list[Directive] = field(default_factory=list)
    log_dests: list[tuple[Directive, str | None]] = field(default_factory=list)
    anonymous_bridges: list[Directive] = field(default_factory=list)
    """The ``connection`` lines of bridges without a ``local_username``."""

    def emit(self, option: str, *value: str) -> None:
        """``option`` (with its value), unless the command line gives it."""
        if option not in self.given:
            self.arguments += [option, *value]

    def take(self, d: Directive) -> None:
        """Translate one directive, or refuse it (:class:`ConfigError`)."""
        name = d.name
        if d.bridge is not None and name in BRIDGE_DIRECTIVES:
            return  # read with its section's ``connection`` line
        special = _SPECIAL.get(name)
        if special is not None:
            special(self, d)
        elif name in SECURITY_KEYS:
            self.security(d)
        elif name in LISTENER_KEYS:
            self.listener_key(d)
        elif name in REFUSED or name.startswith(("auth_opt_", "plugin_opt_")):
            if name in DEFAULT_VALUES and d.words[:1] == [DEFAULT_VALUES[name]]:
                return  # Mosquitto's default: what the server does already
            raise d.error(REFUSED.get(name, PLUGINS))
        elif name in IGNORED:
            self.warnings.append(f"{d.where}: {name}: ignored: {IGNORED[name]}")
        elif name in DIRECTIVES:
            self.setting(d, DIRECTIVES[name])
        else:
            raise d.error(f"unknown directive{nearest(name)}")

    def setting(self, d: Directive, setting: Setting) -> None:
        """A directive that stands for one option: its value checked by the option's kind."""
        kind = setting.kind
        text = d.value if isinstance(kind, (Path, Text)) else _one_word(d)
        if not text:
            raise d.error("needs a value")
        if d.name in UNBOUNDED_AT_ZERO and text == "0":
            default = setting.default
            self.warnings.append(
                f"{d.where}: {d.name}: 0 (no bound in Mosquitto) is not available; the server's bound stays ({default})"
            )
            return
        if d.name in ("port", "bind_address"):
            self.default_listener = True
        if setting.option in self.given:
            return  # the command line's value replaces it, checked there
        value = _parse(d, kind, text)
        if isinstance(kind, Flag):
            if value:
                self.emit(setting.option)
            return
        self.emit(setting.option, text)

    def listener(self, d: Directive) -> None:
        """``listener PORT [ADDRESS]``: a section (each section's directives follow it)."""
        words = d.words
        if words and words[-1].startswith("#"):
            words = words[:1]  # Mosquitto lets a comment follow the port
        if not words or len(words) > 2:
            raise d.error("expected PORT [ADDRESS]")
        try:
            number = int(words[0], 10)
        except ValueError:
            raise d.error(f"the port must be a whole number, not {words[0]!r}") from None
        if number == 0:
            raise d.error("port 0 is Mosquitto's Unix socket listener: Unix sockets are not supported")
        if not 0 < number <= 65535:
            raise d.error(f"the port must be from 1 to 65535, not {number}")
        address = words[1] if len(words) > 1 else ""
        if address:
            _parse(d, Host(), address)
        for other in self.listeners:
            if (other.port, other.address) == (number, address):
                raise d.error(f"a second listener on the same port and address (the first: {other.header.where})")
        section = _Listener(d, number, address)
        self.listeners.append(section)
        self.sections[d] = section

    def connection(self, d: Directive) -> None:
        """``connection NAME``: its section read whole (every bridge of the file checked)
        as one ``--bridge``; a ``--bridge`` on the command line replaces the file's."""
        spec = bridge_argument(d, self.directives)
        if spec.local_username is None:
            self.anonymous_bridges.append(d)
        self.emit("--bridge", spec.text())

    def listener_key(self, d: Directive) -> None:
        """One of a listener's own directives: its section's, or the default listener's."""
        kind = LISTENER_KEYS[d.name]
        text = d.value if isinstance(kind, Path) else _one_word(d)
        if not text:
            raise d.error("needs a value")
        value = _parse(d, kind, text)
        if d.section is not None:
            self.sections[d.section].values[d.name] = value
            return
        # Outside a section: Mosquitto's default listener, the one of port and bind_address.
        if d.name == "protocol" and value == "mqtt":
            return
        option = DEFAULT_LISTENER.get(d.name)
        if option is None:
            raise d.error(
                "outside a listener section (Mosquitto's default listener) this is not supported: "
                "write a listener section (listener PORT [ADDRESS]) and put it there"
            )
        if d.name == "max_connections" and value < 1:
            return  # -1: unbounded in Mosquitto; the server's own per-worker cap stays
        if option in self.given:
            return
        setting = _setting(option)
        if isinstance(setting.kind, Flag):
            if value:
                self.emit(option)
            return
        _parse(d, setting.kind, text)
        self.emit(option, text)

    def security(self, d: Directive) -> None:
        """``password_file``, ``acl_file``, ``allow_anonymous``, ``allow_zero_length_clientid``."""
        self.security_seen = True
        kind = LISTENER_KEYS[d.name]
        text = d.value if isinstance(kind, Path) else _one_word(d)
        if not text:
            raise d.error("needs a value")
        option = SECURITY_OPTIONS[d.name]
        if self.per_listener and d.section is not None:
            self.sections[d.section].values[d.name] = _parse(d, kind, text)
            return
        if self.per_listener:
            self.global_security.append(d)
        if d.name == "allow_anonymous":
            self.anonymous_given = True
        if option in self.given:
            return
        value = _parse(d, kind, text)
        self.emit(option, ("true" if value else "false") if isinstance(value, bool) else text)

    def per_listener_settings(self, d: Directive) -> None:
        """``per_listener_settings true|false``: before any security directive, as Mosquitto insists."""
        value = _parse(d, Flag(), _one_word(d))
        if value and self.security_seen:
            raise d.error(
                "must come before any password_file, acl_file, allow_anonymous or allow_zero_length_clientid "
                "(Mosquitto refuses it too)"
            )
        self.per_listener = value

    def persistent_client_expiration(self, d: Directive) -> None:
        """Mosquitto's duration (``2d``, ``1w``...) as ``--session-expiry`` seconds."""
        text = _one_word(d)
        found = re.fullmatch(r"(\d+)([hdwmy])", text)
        if found is None or int(found.group(1)) == 0:
            raise d.error(
                f"expected a duration such as 1h, 2d, 1w, 1m (30 days) or 1y (365 days), more than 0, not {text!r}"
            )
        self.emit("--session-expiry", str(int(found.group(1)) * EXPIRY_UNITS[found.group(2)]))

    def persistence_directive(self, d: Directive) -> None:
        """``persistence``, ``persistence_location``, ``persistence_file``: one ``--persistence`` at the end."""
        if not d.value:
            raise d.error("needs a value")
        if d.name == "persistence":
            _parse(d, Flag(), _one_word(d))
            self.persistence = d
        elif d.name == "persistence_location":
            self.persistence_location = d
        else:
            if "/" in d.value:
                raise d.error("a file name, without a directory (persistence_location says where)")
            self.persistence_file = d

    def log_type(self, d: Directive) -> None:
        """``log_type``: the most verbose one given is the ``--log-level``."""
        word = _one_word(d)
        if word not in LOG_LEVELS:
            raise d.error(f"must be one of {', '.join(LOG_LEVELS)}, not {word!r}")
        self.log_types.append(d)

    def log_dest(self, d: Directive) -> None:
        """``log_dest``: stderr, stdout, ``file PATH`` or none."""
        word, _, rest = d.value.partition(" ")
        rest = rest.strip()
        if word == "stderr":
            self.log_dests.append((d, None))
        elif word == "stdout":
            self.log_dests.append((d, "-"))
        elif word == "none":
            self.log_dests.append((d, os.devnull))
        elif word == "file":
            if not rest:
                raise d.error("file needs a path")
            if "--log-file" not in self.given:
                _parse(d, LOG_FILE.kind, rest)
            self.log_dests.append((d, rest))
        elif word in ("syslog", "topic", "dlt"):
            raise d.error(
                f"{word} is not supported: stderr (the journal keeps it under systemd), stdout, file PATH or none"
            )
        else:
            raise d.error(f"must be stderr, stdout, file PATH or none, not {d.value!r}")

    def warn_anonymous_bridges(self) -> None:
        """Mosquitto's bridge joins its own broker from inside, unchecked; this server's
        joins through a listener, as a client: refused when anonymous clients are."""
        args = self.arguments
        refused = any(a == "--allow-anonymous" and args[i + 1] == "false" for i, a in enumerate(args[:-1]))
        for d in self.anonymous_bridges if refused else ():
            self.warnings.append(
                f"{d.where}: connection: the bridge joins this server as a client, and anonymous clients are "
                "refused: give it local_username and local_password (from the password file), or it cannot start"
            )

    def finish(self) -> None:
        """What needs every directive read: the listeners, the anonymous rule, persistence, logging."""
        self.finish_listeners()
        if (self.listeners or self.default_listener) and not self.anonymous_given:
            # Mosquitto 2.0: a configured listener refuses anonymous clients unless told.
            self.emit("--allow-anonymous", "false")
        self.warn_anonymous_bridges()
        self.finish_persistence()
        if self.log_types:
            levels = [LOG_LEVELS[_one_word(d)] for d in self.log_types]
            self.emit("--log-level", max(levels, key=VERBOSITY.index))
        if self.log_dests:
            chosen = {dest for _, dest in self.log_dests}
            last, dest = self.log_dests[-1]
            if len(chosen) > 1:
                self.warnings.append(f"{last.where}: log_dest: the server logs to one place: the last log_dest's")
            if dest is not None:
                self.emit("--log-file", dest)

    def finish_listeners(self) -> None:
        if self.per_listener and self.listeners and self.global_security:
            d = self.global_security[0]
            raise d.error(
                "with per_listener_settings true, outside a listener section this is the default listener's "
                "(port), not the listeners': put it in the listener sections it is for"
            )
        if "--listener" in self.given:
            if self.listeners:
                first = self.listeners[0].header
                self.warnings.append(f"{first.where}: listener: the file's listeners are not served: --listener given")
            return
        for section in self.listeners:
            values = dict(section.values)
            if self.per_listener:
                values.setdefault("allow_anonymous", False)  # Mosquitto 2.0's default, per listener
            try:
                spec = ListenerSpec(port=section.port, address=section.address, **values)
            except SettingError as exc:
                raise section.header.error(str(exc)) from None
            self.emit_listener(spec)

    def emit_listener(self, spec: ListenerSpec) -> None:
        self.arguments += ["--listener", spec.text()]

    def finish_persistence(self) -> None:
        on = self.persistence is not None and bool(Flag().parse(_one_word(self.persistence)))
        if not on or "--persistence" in self.given:
            return
        assert self.persistence is not None
        where = self.persistence_location or self.persistence
        folder = self.persistence_location.value if self.persistence_location else ""
        name = self.persistence_file.value if self.persistence_file else PERSISTENCE_FILE
        # Mosquitto joins the two as written (its location must end in '/'); a join is kinder.
        path = os.path.join(folder, name)
        if not os.path.isdir(folder or "."):
            raise where.error(f"{folder} is not a directory")
        if not os.access(folder or ".", os.W_OK):
            raise where.error(f"cannot write in {folder or os.getcwd()} (the store {name} is made there)")
        try:
            with open(path, "rb") as f:
                head = f.read(len(MOSQUITTO_DB_MAGIC))
        except OSError:
            head = b""
        if head == MOSQUITTO_DB_MAGIC:
            assert self.persistence_file is not None  # our own default name is never Mosquitto's file
            raise self.persistence_file.error(
                f"{path} is Mosquitto's own database, which this server neither reads nor overwrites: "
                f"name another file (the default is {PERSISTENCE_FILE})"
            )
        self.emit("--persistence", path)


def _setting(option: str) -> Setting:
    for setting in SETTINGS:
        if setting.option == option:
            return setting
    raise KeyError(option)


def _one_word(d: Directive) -> str:
    """A value of one word; a comment may follow it (as Mosquitto allows), nothing else."""
    words = d.words
    if len(words) > 1 and not words[1].startswith("#"):
        raise d.error(f"takes one value, not {d.value!r}")
    return words[0] if words else ""


def _parse(d: Directive, kind: Any, text: str) -> Any:
    try:
        return kind.parse(text)
    except SettingError as exc:
        raise d.error(str(exc)) from None


_SPECIAL: dict[str, Callable[[_Translation, Directive], None]] = {
    "listener": _Translation.listener,
    "connection": _Translation.connection,
    "per_listener_settings": _Translation.per_listener_settings,
    "persistent_client_expiration": _Translation.persistent_client_expiration,
    "persistence": _Translation.persistence_directive,
    "persistence_location": _Translation.persistence_directive,
    "persistence_file": _Translation.persistence_directive,
    "log_type": _Translation.log_type,
    "log_dest": _Translation.log_dest,
}
"""Directives that are not one option's value."""
