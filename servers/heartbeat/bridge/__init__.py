"""A bridge to another MQTT broker, as Mosquitto's ``connection`` sections configure one
(issue 64): what a bridge is, before anything runs it.

- :mod:`.topics`: the ``topic`` directive (:class:`BridgeTopic`) and the mapping
  Mosquitto makes with it: what the bridge subscribes to on each side, which local
  messages go out and on what remote topic, and what local topic a remote message
  comes in on;
- :mod:`.spec`: one bridge (:class:`BridgeSpec`) with Mosquitto 2.0's defaults, and
  its command-line form, a URL (:func:`parse_bridge`, :meth:`BridgeSpec.text`);
- :mod:`.section`: a configuration file's ``connection`` section as a
  :class:`BridgeSpec`, line by line as Mosquitto reads it (:func:`bridge_from_directives`).

Pure, like the listener it sits beside: nothing here connects, resolves a name, reads
a clock or imports trio. May import: :mod:`..mqtt` and the servers' shared modules
(:mod:`servers.settings`, :mod:`servers.conffile`). The bridge's runtime, which
connects and forwards, is :mod:`..bridging`, a room above the server's.
"""

from __future__ import annotations

from .section import SECTION_DIRECTIVES, bridge_from_directives
from .spec import BRIDGE_KEYS, BridgeAddress, BridgeSpec, RestartTimeout, parse_bridge
from .topics import BridgeTopic, map_incoming, map_outgoing, parse_topic

__all__ = [
    "BRIDGE_KEYS",
    "SECTION_DIRECTIVES",
    "BridgeAddress",
    "BridgeSpec",
    "BridgeTopic",
    "RestartTimeout",
    "bridge_from_directives",
    "map_incoming",
    "map_outgoing",
    "parse_bridge",
    "parse_topic",
]
