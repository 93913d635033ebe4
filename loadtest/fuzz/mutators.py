"""Mutators for ``python -m loadtest fuzz``: a valid input in, a hostile variant out. Pure.

Which mutators each protocol's inputs may get, and how often: :data:`MQTT_MUTATORS` and
:data:`HTTP_MUTATORS`, each the generic ones (:mod:`.mutators_generic`) and its
own (:mod:`.mutators_mqtt`, :mod:`.mutators_http`). What an input and a
mutator are: :mod:`.segments`.
"""

from __future__ import annotations

from .mutators_generic import (
    bit_flip,
    byte_set,
    delete,
    drop,
    duplicate,
    extend,
    insert,
    random_bytes,
    reorder,
    truncate,
)
from .mutators_http import (
    http_chunk_lie,
    http_content_length_lie,
    http_header_mangle,
    http_request_line_mangle,
)
from .mutators_mqtt import (
    mqtt_huge_length,
    mqtt_length_lie,
    mqtt_string_length_lie,
    mqtt_type_flags,
    mqtt_varint_overflow,
)
from .mutators_mqtt5 import (
    mqtt5_bad_utf8,
    mqtt5_duplicate_property,
    mqtt5_property_length_lie,
    mqtt5_varint_overlong,
    mqtt5_wrong_property,
)
from .segments import Mutator

__all__ = ["GENERIC", "HTTP_MUTATORS", "MQTT5_MUTATORS", "MQTT_MUTATORS"]

GENERIC: dict[str, tuple[float, Mutator]] = {
    "bit-flip": (3.0, bit_flip),
    "byte-set": (3.0, byte_set),
    "truncate": (2.0, truncate),
    "extend": (1.5, extend),
    "insert": (1.5, insert),
    "delete": (1.5, delete),
    "random-bytes": (1.0, random_bytes),
    "duplicate": (1.5, duplicate),
    "reorder": (1.5, reorder),
    "drop": (1.0, drop),
}
"""Byte- and segment-level mutators, by name: (weight, mutator)."""

MQTT_MUTATORS: dict[str, tuple[float, Mutator]] = {
    **GENERIC,
    "length-lie": (2.5, mqtt_length_lie),
    "varint-overflow": (1.0, mqtt_varint_overflow),
    "huge-length": (1.0, mqtt_huge_length),
    "type-flags": (1.5, mqtt_type_flags),
    "string-length-lie": (2.0, mqtt_string_length_lie),
    # MQTT 5.0's properties; in a 3.x session they put a property block where 5.0 has one.
    "v5-wrong-property": (0.5, mqtt5_wrong_property),
    "v5-duplicate-property": (0.5, mqtt5_duplicate_property),
    "v5-property-length-lie": (0.5, mqtt5_property_length_lie),
    "v5-bad-utf8": (0.5, mqtt5_bad_utf8),
    "v5-varint-overlong": (0.5, mqtt5_varint_overlong),
}
"""Every mutator an MQTT input may get, by name: (weight, mutator)."""

MQTT5_MUTATORS: dict[str, tuple[float, Mutator]] = {
    **MQTT_MUTATORS,
    **{name: (3.0, mutator) for name, (_, mutator) in MQTT_MUTATORS.items() if name.startswith("v5-")},
}
"""The same mutators for an MQTT 5.0 session, its properties' ones weighted up."""

HTTP_MUTATORS: dict[str, tuple[float, Mutator]] = {
    **GENERIC,
    "content-length-lie": (2.5, http_content_length_lie),
    "chunk-lie": (2.0, http_chunk_lie),
    "header-mangle": (3.0, http_header_mangle),
    "request-line-mangle": (2.0, http_request_line_mangle),
}
"""Every mutator an HTTP input may get, by name: (weight, mutator)."""
