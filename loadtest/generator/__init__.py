"""The device generators: each a process (``python -m loadtest.generator SPEC.json``, run by
:mod:`.pool`) running thousands of MQTT devices on one epoll loop (:mod:`.loop`, whose
names are exported here), from a spec (:mod:`.spec`), with the devices' records, events
and results in modules of their own."""

from __future__ import annotations

from .loop import main, run

__all__ = ["main", "run"]
