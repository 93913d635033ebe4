"""What a fuzz run saw, as plain records: each connection's (:class:`ConnRecord`), the
canary's (:class:`CanaryReport`) and the whole run's (:class:`Observation`).

The runner (:mod:`.runner`) and the canary (:mod:`.canary`) fill them in; the
judge (:mod:`.judge`) reads them. Data only: no I/O, no judgement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENDINGS", "CanaryReport", "ConnRecord", "Observation"]

ENDINGS = ("eof", "reset", "open", "cut", "aborted", "stuck", "connect-failed")
"""How a connection ended, as the client saw it: the server closed it (``eof``) or reset
it; it was still ``open`` when we stopped waiting; we stopped reading a large response
(``cut``); we reset it ourselves right after sending (``aborted``); the server stopped
reading what we sent and never closed (``stuck``); or it never opened."""


@dataclass(slots=True)
class ConnRecord:
    """One fuzz connection, as the client saw it."""

    index: int
    """The case's index (rebuild it with :func:`~.cases.make_case`)."""
    end: str
    """The case's end mode: half-close, wait or abort."""
    peer: str
    """Our address as the server sees it (``host:port``); empty if the connect failed."""
    reply: str
    """MQTT: ``connack-<rc>``, the first packet's type, or ``none``; HTTP: the first status, or ``none``."""
    ending: str
    """One of :data:`ENDINGS`."""
    statuses: tuple[int, ...] = ()
    """HTTP: every status read."""
    received: int = 0
    started: float = 0.0
    """Wall-clock time the connection began (for matching a log line's time)."""
    finished: float = 0.0
    disconnect: str = ""
    """MQTT 5.0: the reason code of the DISCONNECT the server sent before closing (``0x81``),
    ``malformed``, or empty for none."""
    ws: str = ""
    """WebSocket: the server's answer, named as :func:`~.replies.ws_reply` names it
    (``close-1002``, ``http-400``, ``eof``...)."""
    fault: str = ""
    """WebSocket: the case's fault (:attr:`~.corpus.Case.fault`)."""
    expect: tuple[str, ...] = ()
    """WebSocket: the answers the fault warrants (:attr:`~.corpus.Case.expect`)."""
    echo: str = ""
    """WebSocket echo: ``ok`` (what came back is what was sent, in order, as far as it
    goes), ``short`` (less came back than had to), ``wrong`` (something else came
    back), or empty (not checked)."""
    problem: str = ""
    """WebSocket: why the server's answer is one a client must refuse (a frame, or its
    answer to a compression offer)."""
    sent_after: float = 0.0
    """Seconds the fuzzer took from the connect to send the whole input, waiting for the
    server's answer to the handshake left out (loaded, it may be slower than the server's
    deadline for the handshake)."""


@dataclass
class CanaryReport:
    """How the well-behaved clients fared beside the fuzzer."""

    kind: str
    """``mqtt``: devices pinging and a presence subscriber; ``http``: a keep-alive client."""
    clients: int = 0
    exchanges: int = 0
    """PINGREQ/PINGRESP round trips, or HTTP requests answered 200."""
    max_latency: float = 0.0
    max_gap: float = 0.0
    """The longest the canary's own loop was away (a pause of the canary process, not the server's)."""
    probes: int = 0
    """New connections opened to check the server still accepts (each must succeed)."""
    online_seen: int = 0
    """MQTT: canary devices the presence subscriber saw come online (all of them, or the check is void)."""
    false_offline: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """The first few problems, each with when it happened."""
    problem_count: int = 0

    def healthy(self) -> bool:
        """No problem and no false offline."""
        return not self.problems and not self.false_offline


@dataclass
class Observation:
    """Everything the runner saw of one run."""

    protocol: str
    target: str
    requested: int
    records: list[ConnRecord]
    fuzz_seconds: float
    stderr: str
    canary: CanaryReport
    fds: dict[str, int]
    """``before`` (no client), ``canary`` (its clients connected), ``after_run`` (the fuzz
    connections gone), ``after_canary`` (everything gone)."""
    rss: dict[str, float]
    """``warm``, ``mid`` and ``end``: RSS (bytes) once the server was idle after the warm-up
    (a tenth of the inputs), half-way through the rest, and after the run; ``warm_inputs``,
    ``mid_inputs`` and ``end_inputs``: inputs done by then."""
    exit_code: int | None
    """After SIGTERM; None if the server had already died."""
    died: str = ""
    """How and when the server died during the run, if it did."""
    timed_out: bool = False
    presence: list[dict[str, Any]] | None = None
    """MQTT: the presence log's events."""
    canary_peers: set[str] = field(default_factory=set)
    canary_prefix: str = ""
    """MQTT: the canary's client ids start with this (its offline events in the log are checked too)."""
    suspects: list[dict[str, Any]] = field(default_factory=list)
    """Reproducers of the inputs in flight when the server died or first logged a fault."""
    replayed: list[ConnRecord] | None = None
    """A sample of the connections held open (or stuck) during the run, sent again one
    at a time on the idle server after it: None if there was none, or no replay."""
    server_cpu: float = 0.0
    """The server's CPU over the run, in cores (1.0: one core busy all the time)."""
