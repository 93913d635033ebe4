"""``python -m benchmarks.suback``'s measurement, on a small count: two workers, so a
publisher lands on the other worker about half the time; none of the replies is missed."""

from __future__ import annotations

from benchmarks.suback import _server, measure


def test_every_reply_published_just_after_the_suback_arrives() -> None:
    with _server(2, []) as port:
        row = measure(port, port, 16)
    assert row["missed"] == 0
    assert 0 < row["p50"] <= row["p99"]
