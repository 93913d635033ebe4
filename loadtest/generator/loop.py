"""One device-generator process: thousands of MQTT devices on one epoll loop.

    python -m loadtest.generator SPEC.json

One ``epoll`` waits on every socket at once, and the loop sleeps until the next
thing to do: a socket event, a heartbeat, a connect of the ramp, a progress line
(what each does is :mod:`loadtest.generator.events`). A generator holds up to about
19,000 devices (the per-process file limit) for a few percent of a core: it shares
the machine with the server it measures, so its own wake-ups are kept few.

What it runs comes in a spec (:mod:`loadtest.generator.spec`). Progress goes to
stdout as JSON lines; the full results (:mod:`loadtest.generator.report`) go to the
spec's ``results`` file when the run ends.
"""

from __future__ import annotations

import gc
import json
import select
import sys
import time
from typing import Any

from .events import Generator
from .records import CONNECTING
from .report import generator_results
from .spec import GeneratorSpec, read_spec

__all__ = ["main", "run"]

# While ramping, the loop looks for connects to start at least this often.
_RAMP_STEP = 0.02
# What ends a connect(), for better or worse.
_CONNECT_DONE = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP


def progress(gen: Generator, now: float) -> None:
    """One progress line on stdout, for the orchestrator's live view."""
    line = {
        "g": gen.spec.index,
        "t": now,
        "started": gen.started,
        "online": gen.online,
        "failed": gen.connect_failed + gen.refused,
        "pings": gen.pings,
        "detected": gen.detected,
    }
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def run(spec: GeneratorSpec) -> dict[str, Any]:
    """Run one generator to its end time and return its results."""
    gen = Generator(spec)
    # Nothing here is garbage with cycles; the collector would only add pauses.
    gc.collect()
    gc.freeze()
    gc.disable()
    next_progress = 0.0
    order = gen.devices
    while True:
        now = time.monotonic()
        if now >= spec.end_at:
            break
        if gen.started < len(order) and now >= spec.start_at:
            allowed = min(len(order), int((now - spec.start_at) * spec.rate) + 1)
            while gen.started < allowed and gen.inflight < spec.max_inflight:
                gen.open(order[gen.started])
                gen.started += 1
        if now >= next_progress:
            progress(gen, now)
            next_progress = now + 0.5
        # Sleep until the next thing to do: a timer, a progress line, the end, or
        # (while ramping) the next connect. A fixed 20 ms poll had 34 generators of a
        # 500,000-device run waking 1,700 times a second beside the server they measure.
        wake = min(next_progress, spec.end_at)
        if gen.started < len(order):
            wake = min(wake, max(now, spec.start_at) + _RAMP_STEP)
        due = gen.timers.next_deadline()
        if due is not None:
            wake = min(wake, due)
        timeout = max(0.0, wake - now)
        for fd, mask in gen.epoll.poll(timeout, 4096):
            conn = gen.conns.get(fd)
            if conn is None:
                continue
            seen = time.monotonic()
            if conn.phase == CONNECTING:
                if mask & _CONNECT_DONE:
                    gen.on_writable(conn, seen)
            else:
                gen.on_readable(conn, seen)
        gen.timers.run_due(time.monotonic())
    progress(gen, time.monotonic())
    return generator_results(gen)


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the spec file, run, write the results file."""
    args = sys.argv[1:] if argv is None else argv
    spec = read_spec(args[0])
    results = run(spec)
    with open(spec.results, "w") as f:
        json.dump(results, f)
    return 0
