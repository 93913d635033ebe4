"""Faults in a server's stderr: tracebacks, records at ERROR or CRITICAL, fatal or
ignored exceptions; each with its time, summed by kind, or shown in context. Pure.
"""

from __future__ import annotations

import collections
import re
from datetime import datetime

__all__ = ["fault_peers", "fault_summary", "first_fault", "log_faults"]

_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (ERROR|CRITICAL) ")
_FAULT_MARKERS = ("Traceback (most recent call last)", "Exception ignored in", "Fatal Python error")
_GROUP_MARKER = re.compile(r"^\s*\+ Exception Group Traceback")
"""An exception group's traceback, as Python prints one that ends a process: framed in
``+`` and ``|``, its first line indented."""
_ADDRESS = re.compile(r"(?<![\w.:])(\d{1,3}(?:\.\d{1,3}){3}:\d{1,5})(?!\d)")
"""An IPv4 ``host:port``, as the engine's callback errors name the peer (the fuzz
connects over IPv4)."""
_GROUP_CAUSE = re.compile(r"^[\s|]*\| ([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)")


def _marks_fault(line: str) -> bool:
    return bool(_RECORD.match(line) or line.startswith(_FAULT_MARKERS) or _GROUP_MARKER.match(line))


def log_faults(text: str) -> list[tuple[float | None, str]]:
    """Every line of a server's stderr that shows a fault: a traceback, a record at ERROR
    or CRITICAL (in the servers' ``%(asctime)s %(name)s %(levelname)s`` format), a
    fatal or ignored exception. Each with the time of the nearest record at or before
    it (None if there is none) and the line."""
    out: list[tuple[float | None, str]] = []
    last: float | None = None
    for line in text.splitlines():
        stamp = re.match(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if stamp is not None:
            last = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if _marks_fault(line):
            out.append((last, line))
    return out


def fault_peers(text: str) -> list[tuple[float | None, str]]:
    """The ``host:port`` addresses the fault lines of a server's stderr name, in order,
    each with the time of the record that named it (as :func:`log_faults` gives it):
    the peers whose connections the server failed on, where it says so (the engine's
    callback errors do). The time tells apart two connections that came from one
    port in turn, as a client's port is free again once the server has closed first."""
    out: dict[tuple[float | None, str], None] = {}
    for when, line in log_faults(text):
        for address in _ADDRESS.findall(line):
            out.setdefault((when, address), None)
    return list(out)


def fault_summary(text: str) -> collections.Counter[str]:
    """What went wrong, by kind: each traceback's exception line (the first unindented line
    after it), each ERROR or CRITICAL record's logger and message, each fatal or ignored
    exception; with how often each came."""
    out: collections.Counter[str] = collections.Counter()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith(_FAULT_MARKERS[0]):
            while i < len(lines) and (not lines[i] or lines[i][0].isspace()):
                i += 1
            if i < len(lines):
                out[lines[i][:200]] += 1
                i += 1
        elif _GROUP_MARKER.match(line):
            # The innermost exception the group holds: the last one printed in its frame.
            causes = []
            while i < len(lines) and lines[i][:1] in (" ", "|", "+"):
                cause = _GROUP_CAUSE.match(lines[i])
                if cause is not None:
                    causes.append(cause.group(1))
                i += 1
            out[(causes or ["an exception group"])[-1][:200]] += 1
        elif _RECORD.match(line):
            out[line[24:224]] += 1  # without the time: one kind however often it came
        elif line.startswith(_FAULT_MARKERS[1:]):
            out[line[:200]] += 1
    return out


def first_fault(text: str, context: int = 60) -> str:
    """The lines around the first fault in a server's stderr (empty if there is none)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _marks_fault(line):
            return "\n".join(lines[max(0, i - 2) : i + context])
    return ""
