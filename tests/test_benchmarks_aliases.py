"""``python -m benchmarks.aliases``: the bytes a subscriber that allows topic aliases
is sent, beside one that does not, ours and Mosquitto's, in one small real run; and
``read_whole``, the reader its clients (and the shared-subscription benchmark's) use."""

from __future__ import annotations

import pytest

from benchmarks.aliases import main, sensor_topics, skewed
from servers.heartbeat.mqtt.v5.codec import pack, read_whole
from servers.heartbeat.mqtt.v5.packets import Pingresp, Publish


def test_read_whole_takes_whole_packets_and_leaves_the_rest() -> None:
    one, two = pack(Publish("a/b", b"x" * 200)), pack(Pingresp())
    data = one + two
    for cut in range(len(data) + 1):
        packets, used = read_whole(data[:cut])
        whole = [p for p, _ in packets]
        if cut < len(one):
            assert (whole, used) == ([], 0)  # its two-byte length, or its body, still arriving
        elif cut < len(data):
            assert (whole, used) == ([Publish("a/b", b"x" * 200)], len(one))
        else:
            assert [size for _, size in packets] == [len(one), len(two)] and used == len(data)


def test_the_topics_are_skewed_and_repeatable() -> None:
    topics = sensor_topics(20)
    assert len(set(topics)) == 20 and all(t.startswith("sensors/building-") for t in topics)
    picks = skewed(topics, 2000)
    assert picks == skewed(topics, 2000)  # the same seed, the same run
    assert picks.count(topics[0]) > 3 * picks.count(topics[-1])


def test_a_small_run_shows_the_saving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--messages", "400", "--topics", "12", "--timeout", "30"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| idlekeeper")]
    with_aliases, without = rows[0], rows[1]
    assert float(with_aliases[4].strip().rstrip("×")) < 0.8  # most of each topic is not sent again
    assert without[4].strip() == "1.00×" and with_aliases[6].strip() == "yes"
