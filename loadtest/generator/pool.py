"""The generator processes of a device run: started from their specs, their progress
lines followed, and their results read back when they end."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

from servers.workers import module_command

from ..processes import stop
from .spec import GeneratorSpec, write_spec

__all__ = ["GeneratorPool"]


class GeneratorPool:
    """The generator processes, and their latest progress lines."""

    def __init__(self, specs: list[GeneratorSpec], workdir: Path) -> None:
        self.specs = specs
        self.latest: dict[int, dict[str, Any]] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        for spec in specs:
            path = workdir / f"spec-{spec.index}.json"
            write_spec(spec, path)
            proc = subprocess.Popen(
                [*module_command("loadtest.generator"), str(path)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(Path(__file__).resolve().parents[2]),
            )
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(spec.index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.latest[index] = data

    def totals(self) -> dict[str, float]:
        """Progress summed over generators."""
        with self._lock:
            rows = list(self.latest.values())
        keys = ("started", "online", "failed", "pings", "detected")
        return {k: float(sum(r.get(k, 0) for r in rows)) for k in keys}

    def running(self) -> bool:
        """Whether any generator is still running."""
        return any(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Stop any generator still running, by PID."""
        for proc in self.procs:
            stop(proc, timeout=5)

    def results(self) -> list[dict[str, Any]]:
        """Each generator's results file; a generator that left none has a ``missing`` stub."""
        out: list[dict[str, Any]] = []
        for spec in self.specs:
            try:
                out.append(json.loads(Path(spec.results).read_text()))
            except (OSError, ValueError):
                out.append({"index": spec.index, "missing": True})
        return out
