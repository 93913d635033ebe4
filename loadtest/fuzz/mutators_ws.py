"""Mutators for a WebSocket fuzz input, where segment 0 is the opening handshake and
every other segment one frame (:mod:`.ws_frames`). Pure.

Two families:

- **faults** (:data:`WS_FAULTS`, :data:`MQTT_WS_FAULTS`): each breaks RFC 6455 (or
  RFC 7692, or MQTT over WebSockets) in one way, and says what a server may answer
  to it: the close code the RFC gives the fault (1002 protocol error, 1007 invalid
  payload, 1009 too big, 1003 a text frame on MQTT), the HTTP status for a handshake
  it must refuse, :data:`SERVED` for what is no fault at all (a compressed message
  where compression was agreed; a length beyond the data, which leaves the server
  waiting), or :data:`ANY` for blind byte-level damage, whose answer cannot be told
  in advance (only that it is a clear one);
- **shapes** (:data:`WS_SHAPES`): valid reshapings (fragments, control frames
  between them, a zero mask key, a character split across fragments) that a server
  must take as the same messages.

A case gets a few shapes, then one fault (:mod:`.corpus_ws`), so the fault decides
the answer; the faults insert a frame only where a message may start, or within a
message where the fault is to be there, and stop the input where it must end.

This module holds the registries and what each fault expects; the mutators are in
:mod:`.mutators_ws_framing` (masks, lengths, fragmentation, control frames, reserved
bits and opcodes), :mod:`.mutators_ws_messages` (UTF-8, compression, a text frame on
MQTT) and :mod:`.mutators_ws_handshake` (the opening handshake), on the frame
positions of :mod:`.ws_segments`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mutators import GENERIC
from .mutators_ws_framing import (
    shape_control_between,
    shape_fragment,
    shape_ping,
    shape_zero_mask,
    ws_close_bad_code,
    ws_close_bad_utf8,
    ws_close_one_byte,
    ws_continuation_first,
    ws_control_oversized,
    ws_fragmented_control,
    ws_interleaved,
    ws_length_beyond,
    ws_length_msb,
    ws_length_nonminimal,
    ws_length_short,
    ws_reserved_opcode,
    ws_rsv_bits,
    ws_too_big,
    ws_unfinished,
    ws_unmasked,
)
from .mutators_ws_handshake import (
    hs_connection,
    hs_host,
    hs_key,
    hs_method,
    hs_origin,
    hs_path,
    hs_subprotocol,
    hs_upgrade,
    hs_version,
)
from .mutators_ws_messages import (
    shape_utf8_split,
    ws_deflate,
    ws_deflate_bomb,
    ws_deflate_corrupt,
    ws_rsv1_continuation,
    ws_rsv1_control,
    ws_text_bad_utf8,
    ws_text_frame,
    ws_utf8_split_invalid,
)
from .segments import Mutator

__all__ = [
    "ANY",
    "MQTT_WS_FAULTS",
    "MQTT_WS_SHAPES",
    "SERVED",
    "WS_FAULTS",
    "WS_SHAPES",
    "WsFault",
]

SERVED = "served"
"""An outcome token: what a valid input gets (the end the case asked for)."""
ANY = "any"
"""An outcome token: any clear answer (a close frame, an HTTP status below 500, the end)."""


@dataclass(frozen=True)
class WsFault:
    """A fault mutator, how often it is drawn, and what a server may answer to it."""

    weight: float
    mutator: Mutator
    outcomes: tuple[str, ...]
    """``close-<code>``, ``http-<status>``, :data:`SERVED` or :data:`ANY`."""
    unnegotiated: tuple[str, ...] | None = None
    """The outcomes when ``permessage-deflate`` was not agreed, where they differ
    (a compressed frame is then a protocol error, whatever is in it)."""

    def expected(self, negotiated: bool) -> tuple[str, ...]:
        """The outcomes with compression agreed or not."""
        return self.outcomes if negotiated or self.unnegotiated is None else self.unnegotiated


# -- the registries ------------------------------------------------------------------------

_1002 = ("close-1002",)

WS_FAULTS: dict[str, WsFault] = {
    "unmasked": WsFault(2.0, ws_unmasked, _1002),
    "length-nonminimal": WsFault(2.0, ws_length_nonminimal, _1002),
    "length-64-msb": WsFault(1.5, ws_length_msb, _1002),
    "length-beyond-data": WsFault(2.0, ws_length_beyond, (SERVED,)),
    "too-big": WsFault(1.0, ws_too_big, ("close-1009",)),
    "continuation-first": WsFault(2.0, ws_continuation_first, _1002),
    "interleaved-data": WsFault(2.0, ws_interleaved, _1002),
    "fragmented-control": WsFault(2.0, ws_fragmented_control, _1002),
    "unfinished-message": WsFault(1.0, ws_unfinished, (SERVED,)),
    "control-oversized": WsFault(2.0, ws_control_oversized, _1002),
    "close-bad-code": WsFault(2.0, ws_close_bad_code, _1002),
    "close-1-byte": WsFault(1.5, ws_close_one_byte, _1002),
    "close-bad-utf8": WsFault(1.5, ws_close_bad_utf8, ("close-1007",)),
    "reserved-opcode": WsFault(2.0, ws_reserved_opcode, _1002),
    "rsv-bits": WsFault(2.0, ws_rsv_bits, _1002),
    "text-bad-utf8": WsFault(2.0, ws_text_bad_utf8, ("close-1007",)),
    "utf8-split-invalid": WsFault(1.5, ws_utf8_split_invalid, ("close-1007",)),
    "deflate": WsFault(2.0, ws_deflate, (SERVED,), unnegotiated=_1002),
    "deflate-corrupt": WsFault(1.5, ws_deflate_corrupt, ("close-1007",), unnegotiated=_1002),
    "deflate-bomb": WsFault(1.0, ws_deflate_bomb, ("close-1009",), unnegotiated=_1002),
    "rsv1-continuation": WsFault(1.0, ws_rsv1_continuation, _1002),
    "rsv1-control": WsFault(1.0, ws_rsv1_control, _1002),
    "length-short": WsFault(1.0, ws_length_short, (ANY,)),
    "hs-key": WsFault(1.0, hs_key, ("http-400",)),
    "hs-version": WsFault(0.7, hs_version, ("http-426", "http-400")),
    "hs-connection": WsFault(0.7, hs_connection, ("http-400",)),
    "hs-upgrade": WsFault(0.5, hs_upgrade, ("http-200",)),  # a plain GET: the app answers it
    "hs-method": WsFault(0.7, hs_method, ("http-400",)),
    "hs-host": WsFault(0.4, hs_host, ("http-400",)),
    **{name: WsFault(weight / 3, mutator, (ANY,)) for name, (weight, mutator) in GENERIC.items()},
}
"""Every fault a WebSocket input to an ASGI echo app may get, by name."""

_MQTT_ONLY = {
    "text-frame": WsFault(2.0, ws_text_frame, ("close-1003",)),
    "hs-path": WsFault(0.7, hs_path, ("http-404",)),
    "hs-subprotocol": WsFault(0.7, hs_subprotocol, ("http-400",)),
    "hs-origin": WsFault(0.7, hs_origin, ("http-403",)),
}

MQTT_WS_FAULTS: dict[str, WsFault] = {
    **{name: fault for name, fault in WS_FAULTS.items() if name != "too-big"},  # MQTT bounds packets, not frames
    # A text message is refused as text (1003) as soon as its first bytes come, or as
    # invalid UTF-8 (1007) if that shows first.
    "text-bad-utf8": WsFault(2.0, ws_text_bad_utf8, ("close-1007", "close-1003")),
    "utf8-split-invalid": WsFault(1.5, ws_utf8_split_invalid, ("close-1007", "close-1003")),
    # Never negotiated there: a compressed frame is always a protocol error.
    "deflate": WsFault(2.0, ws_deflate, _1002),
    "deflate-corrupt": WsFault(1.5, ws_deflate_corrupt, _1002),
    "deflate-bomb": WsFault(1.0, ws_deflate_bomb, _1002),
    "hs-upgrade": WsFault(0.5, hs_upgrade, ("http-400",)),  # a WebSocket-only listener
    **_MQTT_ONLY,
}
"""Every fault an MQTT-over-WebSocket input may get, by name."""

WS_SHAPES: dict[str, tuple[float, Mutator]] = {
    "fragment": (3.0, shape_fragment),
    "control-between-fragments": (2.0, shape_control_between),
    "ping": (1.5, shape_ping),
    "zero-mask": (1.0, shape_zero_mask),
    "utf8-split-valid": (1.5, shape_utf8_split),
}
"""Valid reshapings of a WebSocket input, by name: (weight, mutator)."""

MQTT_WS_SHAPES = {name: entry for name, entry in WS_SHAPES.items() if name != "utf8-split-valid"}
"""The same for MQTT over WebSockets, where any text frame is a fault."""
