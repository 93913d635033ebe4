"""Input number ``index`` of a fuzz run, from whichever corpus builds it: the
WebSocket targets' (:mod:`.corpus_ws`, which builds on :mod:`.corpus`), or the
plain MQTT and HTTP ones (:mod:`.corpus`). Here, above both, so that neither imports
the other back."""

from __future__ import annotations

from .corpus import V5_SHARE, WS_PROTOCOLS, Case, plain_case
from .corpus_ws import ws_case

__all__ = ["make_case"]


def make_case(seed: int, protocol: str, index: int, v5_share: float = V5_SHARE) -> Case:
    """Input number ``index`` of a run with ``seed`` against a ``protocol`` server; of MQTT
    inputs, ``v5_share`` are 5.0 sessions. A pure function of its arguments."""
    if protocol in WS_PROTOCOLS:
        return ws_case(seed, protocol, index, v5_share)
    return plain_case(seed, protocol, index, v5_share)
