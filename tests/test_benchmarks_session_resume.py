"""``python -m benchmarks.session_resume``'s measurement, on a small count: every way of
asking for a session connects on every server, a resumed one gets what it queued, and
the table has a row for each (Mosquitto's only where it is installed)."""

from __future__ import annotations

import pytest

from benchmarks.session_resume import WAYS, main
from loadtest.mqtt_targets import mosquitto_binary


def test_each_way_of_asking_for_a_session_is_timed_on_each_server(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--devices", "3", "--queued", "2", "--rounds", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith("x")]
    servers = ["idlekeeper", "idlekeeper --workers 2"] + (["mosquitto"] if mosquitto_binary() else [])
    assert len(rows) == len(servers) * len(WAYS)
    for row in rows:
        p50, p99 = float(row[-3]), float(row[-2])
        assert row[-4] in WAYS and 0 < p50 <= p99


def test_its_options_are_bounded() -> None:
    for bad in (["--devices", "0"], ["--queued", "5000"], ["--rounds", "99"]):
        with pytest.raises(SystemExit):
            main(bad)
