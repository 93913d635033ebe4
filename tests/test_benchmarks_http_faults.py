"""``python -m benchmarks.http_faults`` on a small scale: four clients through a stalled
worker, a killed one, hostile input and a killed supervisor, every phase judged."""

from __future__ import annotations

import pytest

from benchmarks.http_faults import main


def test_the_drill_passes_with_a_few_clients(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--clients", "4", "--phase", "1"]) == 0
    out = capsys.readouterr().out
    for phase in ("calm", "stall", "kill a worker", "hostile input", "kill the supervisor"):
        assert any(line.startswith(phase) and line.endswith("PASS") for line in out.splitlines()), out


def test_its_options_are_bounded() -> None:
    for bad in (["--clients", "0"], ["--phase", "600"]):
        with pytest.raises(SystemExit):
            main(bad)
