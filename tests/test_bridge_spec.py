"""A bridge's configuration (issue 64): a Mosquitto ``connection`` section read line by
line as Mosquitto 2.0.11 reads it into a :class:`BridgeSpec`, every directive it takes
either read or refused saying why; the ``--bridge`` form, round-tripped; and
the configuration file refusing a bad section at its line, a good one becoming a
``--bridge`` option."""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path

import pytest

from servers.conffile import ConfigError, Directive, read_config
from servers.heartbeat.bridge import (
    BRIDGE_KEYS,
    SECTION_DIRECTIVES,
    BridgeAddress,
    BridgeSpec,
    BridgeTopic,
    RestartTimeout,
    bridge_from_directives,
    parse_bridge,
    parse_topic,
)
from servers.heartbeat.bridge.section import ALIASES, REFUSED, SPECIAL
from servers.heartbeat.conf import expand_config

from .test_mosquitto_conf import Write, conf, refusal

__all__ = ["conf"]  # the fixture, shared with the configuration tests
from servers.settings import SettingError

# The directives Mosquitto 2.0.11's conf.c reads into its current bridge (cur_bridge).
MOSQUITTO_2_0_11 = [
    "address",
    "addresses",
    "bridge_alpn",
    "bridge_attempt_unsubscribe",
    "bridge_bind_address",
    "bridge_cafile",
    "bridge_capath",
    "bridge_certfile",
    "bridge_identity",
    "bridge_insecure",
    "bridge_keyfile",
    "bridge_max_packet_size",
    "bridge_outgoing_retain",
    "bridge_protocol_version",
    "bridge_psk",
    "bridge_require_ocsp",
    "bridge_tls_version",
    "cleansession",
    "clientid",
    "connection",
    "idle_timeout",
    "keepalive_interval",
    "local_cleansession",
    "local_clientid",
    "local_password",
    "local_username",
    "notification_topic",
    "notifications",
    "notifications_local_only",
    "password",
    "remote_clientid",
    "remote_password",
    "remote_username",
    "restart_timeout",
    "round_robin",
    "start_type",
    "threshold",
    "topic",
    "try_private",
    "username",
]


def section(*lines: str) -> BridgeSpec:
    """The bridge of ``connection NAME`` (the first line) and the lines below it."""
    header = Directive("connection", lines[0].partition(" ")[2], "b.conf", 1)
    directives = [header]
    for number, line in enumerate(lines[1:], start=2):
        name, _, value = line.partition(" ")
        directives.append(Directive(name, value.strip(), "b.conf", number, None, header))
    return bridge_from_directives(directives)


def refused(*lines: str) -> str:
    with pytest.raises(ConfigError) as caught:
        section(*lines)
    message = str(caught.value)
    assert "\n" not in message
    return message


BASE = ("connection cloud", "address broker.example", "topic sensors/# out 1")


def test_every_directive_of_mosquittos_connection_section_is_read_or_refused() -> None:
    assert sorted(SECTION_DIRECTIVES) == sorted(MOSQUITTO_2_0_11)
    assert set(BRIDGE_KEYS) <= {f.name for f in fields(BridgeSpec)}
    for name in SECTION_DIRECTIVES:
        assert name in BRIDGE_KEYS or name in SPECIAL or name in ALIASES or name in REFUSED, name


def test_a_section_gets_mosquitto_2_0s_defaults() -> None:
    spec = section(*BASE)
    assert spec.name == "cloud"
    assert spec.addresses == (BridgeAddress("broker.example", 1883),)
    assert spec.topics == (BridgeTopic("sensors/#", "out", 1),)
    assert spec.bridge_protocol_version == "mqttv311"
    assert (spec.keepalive_interval, spec.idle_timeout, spec.threshold) == (60, 60, 10)
    assert spec.restart_timeout == RestartTimeout(5, 30)
    assert (spec.cleansession, spec.local_clean, spec.round_robin) == (False, False, False)
    assert (spec.notifications, spec.notifications_local_only, spec.try_private) == (True, False, True)
    assert (spec.bridge_attempt_unsubscribe, spec.bridge_outgoing_retain, spec.bridge_max_packet_size) == (
        True,
        True,
        0,
    )
    assert spec.start_type == "automatic"
    assert not spec.tls
    # Client ids: Mosquitto's conf.c (HOSTNAME.NAME; local. and the remote one).
    assert spec.remote_id("box") == "box.cloud"
    assert spec.local_id("box") == "local.box.cloud"
    assert spec.notification("box") == "$SYS/broker/connection/box.cloud/state"


def test_client_ids_and_the_notification_topic_follow_the_remote_client_id() -> None:
    spec = section(*BASE, "remote_clientid edge-7", "notifications_local_only true")
    assert (spec.remote_id("box"), spec.local_id("box")) == ("edge-7", "local.edge-7")
    assert spec.notification("box") == "$SYS/broker/connection/edge-7/state"
    spec = section(*BASE, "local_clientid here", "notification_topic bridges/cloud/state")
    assert (spec.local_id("box"), spec.notification("box")) == ("here", "bridges/cloud/state")


def test_the_old_names_are_still_read() -> None:
    spec = section(*BASE, "clientid edge-7", "username u", "password p w")  # a string is the rest of the line
    assert (spec.remote_clientid, spec.remote_username, spec.remote_password) == ("edge-7", "u", "p w")


def test_addresses_on_one_line_tried_in_turn() -> None:
    spec = section(
        "connection cloud", "addresses a.example:1884 10.0.0.1 2001:db8::1:8883 [::1]:1885 # backups", BASE[2]
    )
    assert spec.addresses == (
        BridgeAddress("a.example", 1884),
        BridgeAddress("10.0.0.1", 1883),
        BridgeAddress("2001:db8::1", 8883),
        BridgeAddress("::1", 1885),
    )


def test_values_are_read_as_mosquitto_reads_them() -> None:
    spec = section(
        *BASE,
        "keepalive_interval 2",  # Mosquitto: "too low, using 5 seconds"
        "idle_timeout 0",
        "threshold -3",
        "bridge_max_packet_size -1",
        "restart_timeout 0 20",
        "cleansession true",
        "cleansession false",  # a flag given twice: the last counts
        "local_cleansession true",
        "bridge_protocol_version mqttv50",
        "start_type lazy",
        "round_robin true",
    )
    assert (spec.keepalive_interval, spec.idle_timeout, spec.threshold, spec.bridge_max_packet_size) == (5, 1, 1, 0)
    assert spec.restart_timeout == RestartTimeout(1, 20)
    assert (spec.cleansession, spec.local_clean) == (False, True)
    assert (spec.bridge_protocol_version, spec.start_type, spec.round_robin) == ("mqttv50", "lazy", True)
    assert section(*BASE, "restart_timeout 20").restart_timeout == RestartTimeout(20, None)


def test_tls_is_on_with_a_ca_and_takes_its_files(tmp_path: Path) -> None:
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    spec = section(
        *BASE,
        f"bridge_cafile {tmp_path / 'ca.pem'}",
        f"bridge_certfile {tmp_path / 'cert.pem'}",
        f"bridge_keyfile {tmp_path / 'key.pem'}",
        "bridge_tls_version tlsv1.3",
        "bridge_alpn mqtt",
        "bridge_insecure true",
        "bridge_require_ocsp false",  # the value that changes nothing
    )
    assert spec.tls and spec.bridge_tls_version == "tlsv1.3" and spec.bridge_insecure
    assert section(*BASE, f"bridge_capath {tmp_path}").tls


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (("connection",), ":1: connection: needs a NAME"),
        (("connection a b",), ":1: connection: expected one NAME"),
        (("connection cloud", BASE[2]), ":1: connection: bridge cloud has no address"),
        (("connection cloud", BASE[1]), ":1: connection: bridge cloud has no topic"),
        ((*BASE, "address other.example"), ":4: address: the hosts are given once, on one line (the first: b.conf:2)"),
        (("connection cloud", "address", BASE[2]), ":2: address: needs HOST[:PORT]"),
        (("connection cloud", "address h:0", BASE[2]), ":2: address: the port of 'h:0' must be a whole number"),
        (("connection cloud", "address h:x", BASE[2]), ":2: address: the port of 'h:x' expected a whole number"),
        (("connection cloud", "address 2001:db8::1", BASE[2]), ":2: address: an IPv6 address needs its port"),
        ((*BASE, "topic a/# sideways"), ":4: topic: the direction must be out, in or both"),
        ((*BASE, 'topic "" in 0 local ""'), ':4: topic: an empty pattern ("") needs both prefixes'),
        ((*BASE, "adress h"), ":4: adress: not a bridge's directive (did you mean address?)"),
        ((*BASE, "keepalive_interval 70000"), ":4: keepalive_interval: must be a whole number of seconds, from 5"),
        ((*BASE, "keepalive_interval 60 30"), ":4: keepalive_interval: takes one value"),
        ((*BASE, "restart_timeout 30 10"), ":4: restart_timeout: the backoff cap (10) is lower than its base (30)"),
        ((*BASE, "restart_timeout 1 2 3"), ":4: restart_timeout: expected SECONDS or BASE CAP"),
        ((*BASE, "bridge_protocol_version mqttv31"), ":4: bridge_protocol_version: mqttv31 (MQTT 3.1) is not spoken"),
        ((*BASE, "bridge_protocol_version mqttv5"), ":4: bridge_protocol_version: must be mqttv311 or mqttv50"),
        ((*BASE, "start_type manual"), ":4: start_type: manual is not supported (nor by Mosquitto)"),
        ((*BASE, "start_type eager"), ":4: start_type: must be automatic, lazy or once"),
        ((*BASE, "cleansession maybe"), ":4: cleansession: must be true or false"),
        ((*BASE, "remote_clientid a", "clientid b"), ":5: clientid: given twice (the first: b.conf:4)"),
        ((*BASE, "remote_password p"), ":4: remote_password: remote_password needs remote_username"),
        ((*BASE, "local_password p"), ":4: local_password: local_password needs local_username"),
        ((*BASE, "notification_topic a/#"), ":4: notification_topic: must be a topic to publish to"),
        ((*BASE, "bridge_cafile /nonexistent/ca.pem"), ":4: bridge_cafile: cannot read /nonexistent/ca.pem"),
        ((*BASE, "bridge_capath /nonexistent"), ":4: bridge_capath: /nonexistent is not a directory"),
        ((*BASE, "bridge_tls_version tlsv1.0"), ":4: bridge_tls_version: must be one of tlsv1.3, tlsv1.2, tlsv1.1"),
        ((*BASE, "bridge_insecure true"), ":4: bridge_insecure: bridge_insecure needs bridge_cafile or bridge_capath"),
        ((*BASE, "bridge_alpn mqtt"), ":4: bridge_alpn: bridge_alpn needs bridge_cafile or bridge_capath"),
        ((*BASE, "bridge_psk 0123"), ":4: bridge_psk: TLS-PSK is not supported"),
        ((*BASE, "bridge_identity me"), ":4: bridge_identity: TLS-PSK is not supported"),
        ((*BASE, "bridge_require_ocsp true"), ":4: bridge_require_ocsp: OCSP is not checked"),
        ((*BASE, "bridge_max_packet_size 300000000"), ":4: bridge_max_packet_size: must be a whole number of bytes"),
        ((*BASE, "bridge_bind_address no.such.host.invalid"), ":4: bridge_bind_address: cannot resolve"),
    ],
)
def test_a_bad_section_is_refused_at_its_line_saying_why(lines: tuple[str, ...], reason: str) -> None:
    assert refused(*lines).startswith(f"b.conf{reason}")


def test_a_certificate_without_its_key_or_its_ca_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "ca.pem").write_text("x")
    cert, ca = f"bridge_certfile {tmp_path / 'cert.pem'}", f"bridge_cafile {tmp_path / 'ca.pem'}"
    assert "bridge_certfile: bridge_certfile needs bridge_keyfile" in refused(*BASE, ca, cert)
    (tmp_path / "key.pem").write_text("x")
    key = f"bridge_keyfile {tmp_path / 'key.pem'}"
    assert "bridge_certfile needs bridge_cafile or bridge_capath: TLS is on only with one" in refused(*BASE, cert, key)


# -- the restart timeout's backoff --------------------------------------------------------


def test_the_restart_timeout_is_a_constant_or_a_jittered_backoff_under_its_cap() -> None:
    assert RestartTimeout(20, None).next_delay(20, random.uniform) == 20
    backoff = RestartTimeout(5, 30)
    assert backoff.next_delay(5, lambda low, high: high) == 15
    assert backoff.next_delay(15, lambda low, high: high) == 30  # 45, held to the cap
    assert backoff.next_delay(15, lambda low, high: low) == 5
    draws = [backoff.next_delay(10, random.Random(seed).uniform) for seed in range(50)]
    assert all(5 <= d <= 30 for d in draws)


# -- the command-line form ---------------------------------------------------------------


def test_the_command_line_form_round_trips(tmp_path: Path) -> None:
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    specs = [
        section(*BASE),
        section(
            "connection to-cloud",
            "address a.example:8883 [2001:db8::1]:8883",
            'topic sensors/# out 1 "" site-7/',
            "topic cmd/+/set in 2 local/ remote/",
            'topic "" both 0 here/state there/state',
            "round_robin true",
            "remote_username user name",
            "remote_password p&ss=w%rd #1",
            "restart_timeout 10 60",
            "bridge_protocol_version mqttv50",
            f"bridge_cafile {tmp_path / 'ca.pem'}",
            f"bridge_certfile {tmp_path / 'cert.pem'}",
            f"bridge_keyfile {tmp_path / 'key.pem'}",
            "cleansession true",
            "local_cleansession false",
            "notifications false",
            "start_type once",
            "bridge_max_packet_size 65536",
        ),
    ]
    for spec in specs:
        assert parse_bridge(spec.text()) == spec, spec.text()
    assert specs[0].text() == "mqtt://broker.example:1883/cloud?topic=sensors/#%20out%201"
    assert specs[1].text().startswith("mqtts://a.example:8883,[2001:db8::1]:8883/to-cloud?topic=sensors/#%20out%201")


def test_the_command_line_form_as_an_operator_writes_it() -> None:
    spec = parse_bridge("mqtt://broker.example/cloud?topic=a/+/b/# both 1&keepalive_interval=30")
    assert spec.addresses == (BridgeAddress("broker.example", 1883),)
    assert spec.topics == (BridgeTopic("a/+/b/#", "both", 1),)  # "+" is a wildcard, never a blank
    assert spec.keepalive_interval == 30


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("redis://h/cloud?topic=a", "expected mqtt://HOST[:PORT][,HOST[:PORT]...]/NAME?topic="),
        ("mqtt://h?topic=a", "needs the bridge's name after the hosts"),
        ("mqtt://h/cloud", "bridge cloud has no topic"),
        ("mqtt:///cloud?topic=a", "bridge cloud has no address"),
        ("mqtt://h/cloud?topic=a&keepalive=5", "a bridge has no option 'keepalive' (did you mean keepalive_interval?)"),
        (
            "mqtt://h/cloud?topic=a&keepalive_interval=2",
            "keepalive_interval: must be a whole number of seconds, from 5",
        ),
        ("mqtt://h/cloud?topic=a&round_robin=true&round_robin=false", "round_robin is given twice"),
        ("mqtt://h/cloud?topic=a%20up", "topic: the direction must be out, in or both, not 'up'"),
        ("mqtts://h/cloud?topic=a", "mqtts:// needs bridge_cafile or bridge_capath"),
        ("mqtt://h:99999/cloud?topic=a", "the port of 'h:99999' must be a whole number, from 1 to 65535"),
    ],
)
def test_a_bad_command_line_form_is_refused_saying_why(text: str, reason: str) -> None:
    with pytest.raises(SettingError) as caught:
        parse_bridge(text)
    assert reason in str(caught.value)


# -- in the configuration file -----------------------------------------------------------



def test_a_bridge_section_runs_beside_the_listener_section(conf: Write) -> None:
    path = conf("listener 1883", "connection a", "max_qos 1", "listener 1884", "address h", "connection b", "topic t")
    placed = [
        (d.name, d.section and d.section.value, d.bridge and d.bridge.value) for d in read_config(path).directives
    ]
    assert placed == [
        ("listener", None, None),
        ("connection", None, None),
        ("max_qos", "1883", "a"),  # still the listener's, as in Mosquitto
        ("listener", None, None),
        ("address", "1884", "a"),  # still the bridge's, as in Mosquitto
        ("connection", None, None),
        ("topic", "1884", "b"),
    ]


def test_a_good_bridge_becomes_a_bridge_option(conf: Write) -> None:
    path = conf(
        "listener 1883",
        "connection cloud",
        "address broker.example:8883",
        "topic a/# out 1",
        "max_qos 1",  # the listener's, still
        "topic b in",
        "keepalive_interval 30",
        "connection other",
        "address h",
        "topic c both",
    )
    arguments, warnings = expand_config(["-c", str(path)])
    given = [arguments[i + 1] for i, a in enumerate(arguments) if a == "--bridge"]
    assert [parse_bridge(url) for url in given] == [
        BridgeSpec(
            "cloud",
            (BridgeAddress("broker.example", 8883),),
            (parse_topic("a/# out 1"), parse_topic("b in")),
            keepalive_interval=30,
        ),
        BridgeSpec("other", (BridgeAddress("h"),), (parse_topic("c both"),)),
    ]
    # Anonymous clients are refused (Mosquitto 2's default with a listener), and the
    # bridge joins this server as a client: each bridge without local credentials is told.
    assert [w.partition(": connection: ")[0] for w in warnings] == [f"{path}:2", f"{path}:8"]
    assert "give it local_username and local_password" in warnings[0]


def test_a_bridge_on_the_command_line_replaces_the_files(conf: Write) -> None:
    path = conf("connection cloud", "address h", "topic a")
    arguments, _ = expand_config(["-c", str(path), "--bridge", "mqtt://g/mine?topic=b"])
    assert [a for a in arguments if "://" in a] == ["mqtt://g/mine?topic=b"]


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (("connection cloud", "address h", "topic a", "keepalive_interval x"), ":5: keepalive_interval: expected"),
        (
            ("connection cloud", "address h", "topic a", "adress h"),
            ":5: adress: unknown directive (did you mean address?)",
        ),
        (("connection cloud", "address h", "topic a", "listener 1883", "topik b"), ":6: topik: unknown directive"),
        (("connection cloud", "address h"), ":2: connection: bridge cloud has no topic"),
        (
            ("connection cloud", "address h", "topic a", "connection cloud", "address g", "topic b"),
            ":5: connection: a second bridge named cloud (the first:",
        ),
        (
            (
                *("connection a", "address h", "topic a", "remote_clientid x"),
                *("connection b", "address g", "topic b", "remote_clientid x"),
            ),
            ":6: connection: its local client id local.x is the bridge's at",
        ),
        # A line the bridge does not read comes after the bridge's own refusal.
        (("connection cloud", "address h", "max_keepalive 0"), ":2: connection: bridge cloud has no topic"),
        (("address h",), ":2: address: a bridge's directive, of a connection section: here no connection NAME"),
    ],
)
def test_a_bad_bridge_in_a_file_is_refused_at_its_line_before_the_bridge_is(
    conf: Write, lines: tuple[str, ...], reason: str
) -> None:
    path = conf("# bridges", *lines)
    assert refusal(path).startswith(f"{path}{reason}")
