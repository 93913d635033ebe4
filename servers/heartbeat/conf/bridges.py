"""A configuration file's bridges (``connection`` sections), read and checked (issue 64):
a section that is wrong is refused at its line with its own reason; one that is right
becomes a ``--bridge`` argument (:func:`bridge_argument`), which the bridge's runtime
(:mod:`..bridging`) runs."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from ...conffile import Directive
from ..bridge import SECTION_DIRECTIVES, BridgeSpec, bridge_from_directives
from .directives import known, nearest

__all__ = ["bridge_argument", "bridges"]


def bridges(directives: Sequence[Directive]) -> list[tuple[Directive, BridgeSpec]]:
    """Each ``connection`` section of ``directives`` (a whole file's) and its bridge, in
    order; :class:`ConfigError` at the line that is wrong. Mosquitto's rules across
    sections hold too: a name once, a local client id once."""
    out: list[tuple[Directive, BridgeSpec]] = []
    everything = set(known()) | set(SECTION_DIRECTIVES)
    for header in (d for d in directives if d.name == "connection"):
        lines = []
        for d in directives:
            if d.bridge is not header:
                continue
            if d.name not in everything:
                raise d.error(f"unknown directive{nearest(d.name)}")
            if d.name in SECTION_DIRECTIVES:
                lines.append(d)
        spec = bridge_from_directives([header, *lines])
        for other, earlier in out:
            if earlier.name == spec.name:
                raise header.error(f"a second bridge named {spec.name} (the first: {other.where})")
        out.append((header, spec))
    hostname = socket.gethostname()
    ids: dict[str, Directive] = {}
    for header, spec in out:
        local = spec.local_id(hostname)
        if local in ids:
            raise header.error(
                f"its local client id {local} is the bridge's at {ids[local].where} too: set local_clientid "
                "(or remote_clientid) in one of them (Mosquitto refuses it too)"
            )
        ids[local] = header
    return out


def bridge_argument(first: Directive, directives: Sequence[Directive]) -> BridgeSpec:
    """The bridge of the section ``first`` begins (its ``--bridge`` value is its
    :meth:`~BridgeSpec.text`), every section of the file checked first
    (:class:`ConfigError` at the line that is wrong)."""
    return next(spec for header, spec in bridges(directives) if header is first)
