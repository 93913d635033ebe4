"""``-c/--config FILE``: the heartbeat server reads a Mosquitto 2.0 configuration file
(see docs/how-to/from-mosquitto.md) by turning it into command-line arguments.

:func:`expand_config` finds ``-c FILE`` in the arguments, reads the file
(:mod:`servers.conffile`), checks every directive's value as its option would be
checked, and puts the file's arguments *before* the command line's, so that an option
given on the command line overrides the file (argparse keeps the last value; an option
the command line gives is not even taken from the file, so a path the file names that
cannot be used here does not stop a command line that replaces it). A directive that
cannot be honoured is refused in one line, ``FILE:LINE: DIRECTIVE: why``; one that
changes nothing here is ignored with a warning.

The directives:

- Mosquitto's own, by its names, where the server has the option
  (:data:`MOSQUITTO_NAMES`), with Mosquitto's rules: a ``listener`` section becomes a
  ``--listener`` URL; ``password_file``, ``acl_file``, ``allow_anonymous`` and
  ``allow_zero_length_clientid`` are the whole server's unless ``per_listener_settings
  true`` puts them in their listener; with a listener (or ``port``) and no
  ``allow_anonymous``, anonymous clients are refused, as Mosquitto 2.0 does;
- every option of the server that Mosquitto has no name for, named as the option
  without its dashes, ``_`` for ``-`` (``--presence-prefix`` is ``presence_prefix``);
  a flag takes ``true`` or ``false``;
- a bridge's ``connection`` section is read whole and checked (:mod:`..bridge`), so a
  wrong line is refused at its line, and becomes a ``--bridge`` (a bridge without
  local credentials, where anonymous clients are refused, is warned of: it joins the
  server as a client);
- Mosquitto's others are refused saying why (:data:`REFUSED`), or ignored with a
  warning where they change nothing that matters here (:data:`IGNORED`).

Its modules: :mod:`.directives` (the tables: each directive's option, refusal or
warning), :mod:`.translation` (the file's directives to arguments) and
:mod:`.bridges` (the file's bridges, checked).
"""

from __future__ import annotations

from .directives import DIRECTIVES, IGNORED, MOSQUITTO_NAMES, PERSISTENCE_FILE, REFUSED
from .translation import config_file, expand_config, translate

__all__ = [
    "DIRECTIVES",
    "IGNORED",
    "MOSQUITTO_NAMES",
    "PERSISTENCE_FILE",
    "REFUSED",
    "config_file",
    "expand_config",
    "translate",
]
