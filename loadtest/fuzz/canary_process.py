"""The canary (:mod:`.canary`) seen from the fuzzer: its process started, waited for
until its clients are connected, stopped by closing its stdin, and its report read.
"""

from __future__ import annotations

import json
import subprocess

import trio

from servers.workers import module_command

from ..processes import stop
from .observation import CanaryReport
from .targets import ROOT

__all__ = ["CANARY_START", "CanaryProcess"]

CANARY_START = 30.0
"""Seconds the canary process gets to connect, and to stop and report."""


class CanaryProcess:
    """The canary (:mod:`.canary`) in a process of its own, stopped by closing its stdin."""

    def __init__(self, protocol: str, port: int, tag: str, presence: bool = True) -> None:
        self.protocol = protocol
        self.tag = tag
        cmd = [*module_command("loadtest.fuzz.canary"), "--protocol", protocol, "--port", str(port)]
        if protocol in ("mqtt", "mqtt-ws") and not presence:
            cmd.append("--no-presence")
        self.proc = subprocess.Popen(
            [*cmd, "--tag", tag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

    async def ready(self) -> None:
        """Return once every canary client is connected (raise if it says otherwise)."""
        assert self.proc.stdout is not None
        line = ""
        with trio.move_on_after(CANARY_START):
            line = await trio.to_thread.run_sync(self.proc.stdout.readline, abandon_on_cancel=True)
        if '"ready": true' not in line:
            stop(self.proc)
            raise RuntimeError(f"the canary did not start (exit code {self.proc.returncode})")

    async def stop(self) -> tuple[CanaryReport, set[str]]:
        """Stop it; its report and its connections' addresses."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = ""
        with trio.move_on_after(CANARY_START):
            out = await trio.to_thread.run_sync(self.proc.stdout.read, abandon_on_cancel=True)
        code = stop(self.proc, timeout=5.0)
        try:
            report = json.loads(out.strip().splitlines()[-1])
            peers = set(report.pop("peers"))
            return CanaryReport(**report), peers
        except (ValueError, IndexError, KeyError, TypeError):
            return CanaryReport(self.protocol, problems=[f"the canary process failed (exit code {code})"]), set()

    def kill(self) -> None:
        """Stop it by its PID, whatever it is doing."""
        stop(self.proc, timeout=5.0)
