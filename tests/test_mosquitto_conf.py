"""``-c/--config FILE`` (issue 63): the reader of Mosquitto's configuration format
(:mod:`servers.conffile`) and its translation into the heartbeat server's arguments
(:mod:`servers.heartbeat.conf`): every refusal names FILE:LINE and the directive, the
command line overrides the file, and the refusals reach the operator in one line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from servers.conffile import ConfigError, include_order, read_config
from servers.heartbeat.__main__ import parser
from servers.heartbeat.conf import DIRECTIVES, MOSQUITTO_NAMES, PERSISTENCE_FILE, expand_config, translate
from servers.heartbeat.listener import parse_listener
from servers.heartbeat.settings import SETTINGS

ROOT = Path(__file__).resolve().parent.parent

Write = Callable[..., str]


@pytest.fixture
def conf(tmp_path: Path) -> Write:
    """Writes a configuration file (lines joined) and returns its path."""

    def write(*lines: str, name: str = "mosquitto.conf") -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    return write


def refusal(path: str) -> str:
    with pytest.raises(ConfigError) as caught:
        translate(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


# -- the reader -----------------------------------------------------------------------------


def test_reader_skips_comments_and_blank_lines_and_knows_each_line(conf: Write) -> None:
    path = conf("# a comment", "", "   ", "max_keepalive 60", "  # indented comment", "  log_type   debug  ")
    parsed = read_config(path)
    assert [(d.name, d.value, d.line) for d in parsed.directives] == [
        ("max_keepalive", "60", 4),
        ("log_type", "debug", 6),
    ]
    assert parsed.directives[0].where == f"{path}:4"


def test_a_listener_section_runs_to_the_next_and_stops_at_the_end_of_its_file(conf: Write, tmp_path: Path) -> None:
    conf("max_qos 1", "listener 1884 127.0.0.1", "max_qos 0", name="d/a.conf")
    path = conf("listener 1883 127.0.0.1", "max_qos 2", f"include_dir {tmp_path / 'd'}", "max_connections 5")
    parsed = read_config(path)
    sections = [(d.name, d.section.value if d.section else None) for d in parsed.directives]
    assert sections == [
        ("listener", None),
        ("max_qos", "1883 127.0.0.1"),
        ("max_qos", None),  # an included file starts outside any section, as in Mosquitto
        ("listener", None),
        ("max_qos", "1884 127.0.0.1"),
        ("max_connections", "1883 127.0.0.1"),  # back in the main file, its section goes on
    ]


def test_include_dir_reads_conf_files_in_mosquittos_order(conf: Write, tmp_path: Path) -> None:
    for name in ("b.conf", "B.conf", "a.conf", "A.conf", "ab.conf", "notes.txt", ".conf"):
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / "d" / name).write_text(f"presence_prefix {name}/\n")
    (tmp_path / "d" / "nested.conf").write_text(f"include_dir {tmp_path}\n")
    parsed = read_config(conf(f"include_dir {tmp_path / 'd'}"))
    assert [Path(f).name for f in parsed.files[1:]] == [
        "A.conf",
        "a.conf",
        "ab.conf",
        "B.conf",
        "b.conf",
        "nested.conf",
    ]
    assert include_order(["b", "a", "B", "A", "a0"]) == ["A", "a", "a0", "B", "b"]
    # Only the main file's include_dir is read, as in Mosquitto; the operator is told.
    assert parsed.warnings == [
        f"{tmp_path / 'd' / 'nested.conf'}:1: include_dir: ignored: only the main file's is read"
    ]


def test_include_dir_that_cannot_be_read_is_refused_at_its_line(conf: Write, tmp_path: Path) -> None:
    path = conf("max_keepalive 60", f"include_dir {tmp_path / 'absent'}")
    assert refusal(path) == f"{path}:2: include_dir: cannot open {tmp_path / 'absent'}: No such file or directory"
    assert refusal(conf("include_dir")).endswith(":1: include_dir: needs a directory")


def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    assert refusal(str(tmp_path / "nope.conf")) == f"cannot read {tmp_path / 'nope.conf'}: No such file or directory"


def test_a_line_not_in_utf8_is_refused_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.conf"
    path.write_bytes(b"max_keepalive 60\nuser \xff\n")
    assert refusal(str(path)) == f"{path}:2: not UTF-8 text"


# -- directives -----------------------------------------------------------------------------


def test_every_setting_of_the_server_is_a_directive() -> None:
    names = {s.option: name for name, s in DIRECTIVES.items()}
    for setting in SETTINGS:
        if setting.hidden or setting.option in ("--config", "--listener", "--bridge"):
            continue  # sections in a file (--bridge: a connection section), not directives
        expected = MOSQUITTO_NAMES.get(setting.option, setting.option.lstrip("-").replace("-", "_"))
        assert names[setting.option] == expected
    assert DIRECTIVES["presence_prefix"].option == "--presence-prefix"
    assert DIRECTIVES["max_inflight_messages"].option == "--max-inflight"


def test_directives_become_the_options_they_stand_for(conf: Write) -> None:
    path = conf(
        "max_keepalive 120",
        "max_packet_size 65536",
        "max_inflight_messages 10",
        "max_queued_messages 500",
        "max_queued_bytes 1000000",
        "autosave_interval 60",
        "persistent_client_expiration 2d",
        "connection_messages true",
        "presence_prefix devices/presence/",
        "no_retain_presence false",
        "engine streams # a comment after a value of one word",
        "log_type error",
        "log_type information",
        "log_type warning",
        "sys_interval 10",
    )
    arguments, warnings = translate(path)
    assert warnings == []
    assert arguments == [
        "--max-keepalive", "120",
        "--max-packet-size", "65536",
        "--max-inflight", "10",
        "--max-queued", "500",
        "--max-queued-bytes", "1000000",
        "--autosave-interval", "60",
        "--session-expiry", "172800",
        "--connection-messages",
        "--presence-prefix", "devices/presence/",
        "--engine", "streams",
        "--sys-interval", "10",
        "--log-level", "INFO",  # the most verbose log_type
    ]  # fmt: skip
    args = parser().parse_args(arguments)
    assert (args.max_keepalive, args.session_expiry, args.connection_messages) == (120, 172800.0, True)
    assert not args.no_retain_presence  # a flag's false gives nothing


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("max_keepalive 0", "max_keepalive: must be a whole number of seconds, from 1 to 65535, not 0"),
        ("max_keepalive sixty", "max_keepalive: expected a whole number of seconds, from 1 to 65535, not 'sixty'"),
        ("max_keepalive 60 90", "max_keepalive: takes one value, not '60 90'"),
        ("max_keepalive", "max_keepalive: needs a value"),
        ("max_qos 3", "max_qos: must be a whole number, from 0 to 2, not 3"),
        ("engine turbo", "engine: must be one of dense, streams, not 'turbo'"),
        ("connection_messages maybe", "connection_messages: must be true or false, not 'maybe'"),
        ("password_file /nonexistent/pw", "password_file: cannot read /nonexistent/pw: No such file or directory"),
        ("persistent_client_expiration 3", "persistent_client_expiration: expected a duration such as 1h"),
        ("persistent_client_expiration 0d", "persistent_client_expiration: expected a duration such as 1h"),
        ("log_type chatty", "log_type: must be one of none, error, warning"),
        ("log_dest syslog", "log_dest: syslog is not supported: stderr"),
        ("log_dest file", "log_dest: file needs a path"),
        ("log_dest carrier-pigeon", "log_dest: must be stderr, stdout, file PATH or none"),
        ("bind_address no.such.host.invalid", "bind_address: cannot resolve no.such.host.invalid"),
        ("maxkeepalive 60", "maxkeepalive: unknown directive (did you mean max_keepalive?)"),
        ("auth_file pw", "auth_file: unknown directive (--auth-file is written password_file)"),
        ("auth_plugin /usr/lib/x.so", "auth_plugin: plugins are not supported"),
        ("plugin_opt_x 1", "plugin_opt_x: plugins are not supported"),
        ("psk_hint hint", "psk_hint: TLS-PSK is not supported"),
        ("mount_point a/", "mount_point: mount points are not supported"),
        ("memory_limit 1000", "memory_limit: not supported"),
        ("connection bridge-1", "connection: bridge bridge-1 has no address (address HOST[:PORT]"),
        ("address 10.0.0.1:1883", "address: a bridge's directive, of a connection section: here no connection NAME"),
        ("listener 0 /tmp/mosquitto.sock", "listener: port 0 is Mosquitto's Unix socket listener"),
        ("listener 70000", "listener: the port must be from 1 to 65535, not 70000"),
        ("listener", "listener: expected PORT [ADDRESS]"),
        ("protocol websockets", "protocol: outside a listener section (Mosquitto's default listener)"),
        ("worker_index 1", "worker_index: unknown directive"),
    ],
)
def test_a_directive_that_cannot_be_used_is_refused_at_its_line(conf: Write, line: str, reason: str) -> None:
    path = conf("# first", line)
    assert refusal(path).startswith(f"{path}:2: {reason}")


def test_the_defaults_of_refused_directives_pass_and_harmless_ones_are_warned(conf: Write) -> None:
    path = conf(
        "message_size_limit 0",
        "max_inflight_bytes 0",
        "memory_limit 0",
        "retain_available true",
        "user mosquitto",
        "log_timestamp true",
        "max_queued_messages 0",
    )
    arguments, warnings = translate(path)
    # Mosquitto's defaults of the three it honours are the server's too: said again, harmless.
    assert arguments == ["--message-size-limit", "0", "--max-inflight-bytes", "0", "--retain-available", "true"]
    assert warnings == [
        f"{path}:5: user: ignored: this server does not drop privileges: run it as the user it should run as "
        "(systemd's User=)",
        f"{path}:6: log_timestamp: ignored: every log line starts with its time",
        f"{path}:7: max_queued_messages: 0 (no bound in Mosquitto) is not available; the server's bound stays (1000)",
    ]


def test_retain_available_and_message_size_limit_become_the_servers_options(conf: Write) -> None:
    path = conf("retain_available false", "message_size_limit 1000")
    arguments, warnings = translate(path)
    assert arguments == ["--retain-available", "false", "--message-size-limit", "1000"]
    assert warnings == []
    args = parser().parse_args(arguments)
    assert (args.retain_available, args.message_size_limit) == ("false", 1000)
    assert refusal(conf("retain_available maybe")).endswith("must be one of true, false, not 'maybe'")
    assert "message_size_limit" in refusal(conf("message_size_limit -1"))


def test_the_default_listener_sets_the_servers_own_options(conf: Write, tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("")
    path = conf(
        "port 8883",
        "bind_address 127.0.0.1",
        f"certfile {cert}",
        f"keyfile {key}",
        f"cafile {ca}",
        "require_certificate true",
        "max_connections -1",
        "max_qos 1",
        "protocol mqtt",
    )
    arguments, _ = translate(path)
    assert arguments == [
        "--port", "8883", "--host", "127.0.0.1", "--tls-cert", str(cert), "--tls-key", str(key),
        "--tls-ca-file", str(ca), "--tls-require-certificate", "--max-qos", "1",
        "--allow-anonymous", "false",  # a port: not local only, so Mosquitto 2.0 refuses anonymous clients
    ]  # fmt: skip


def test_without_a_listener_anonymous_clients_are_let_in_as_by_mosquitto(conf: Write) -> None:
    assert translate(conf("max_keepalive 60"))[0] == ["--max-keepalive", "60"]


# -- listeners ------------------------------------------------------------------------------


def test_listener_sections_become_listener_urls(conf: Write, tmp_path: Path) -> None:
    cert, key, ca, pw, acl = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem", "pw", "acl"))
    for f in (cert, key, ca, pw, acl):
        f.write_text("")
    path = conf(
        "listener 1883 127.0.0.1",
        "max_keepalive 60",  # a global directive, wherever it is written (as in Mosquitto)
        "listener 8883 127.0.0.1",
        f"certfile {cert}",
        f"keyfile {key}",
        f"cafile {ca}",
        "require_certificate true",
        "use_identity_as_username true",
        "max_connections 100",
        f"password_file {pw}",  # per_listener_settings false: the whole server's
        "listener 9001 127.0.0.1",
        "protocol websockets",
        "max_qos 1",
        f"acl_file {acl}",
    )
    arguments, warnings = translate(path)
    assert warnings == []
    listeners = [arguments[i + 1] for i, a in enumerate(arguments) if a == "--listener"]
    specs = [parse_listener(text) for text in listeners]
    assert [(s.scheme, s.address, s.port) for s in specs] == [
        ("mqtt", "127.0.0.1", 1883),
        ("mqtts", "127.0.0.1", 8883),
        ("ws", "127.0.0.1", 9001),
    ]
    tls = specs[1]
    assert (tls.certfile, tls.keyfile, tls.cafile) == (str(cert), str(key), str(ca))
    assert tls.require_certificate and tls.use_identity_as_username and tls.max_connections == 100
    assert specs[2].max_qos == 1
    assert all(s.password_file is None and s.acl_file is None for s in specs)
    assert arguments[:6] == ["--max-keepalive", "60", "--auth-file", str(pw), "--acl-file", str(acl)]
    assert arguments[-2:] == ["--allow-anonymous", "false"]  # listeners, and no allow_anonymous
    args = parser().parse_args(arguments)
    assert args.listener == specs


def test_a_listener_that_cannot_work_is_refused_at_its_line(conf: Write, tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    key.write_text("")
    path = conf("listener 1883 127.0.0.1", "listener 8883 127.0.0.1", f"keyfile {key}")
    assert refusal(path) == f"{path}:2: listener: keyfile needs certfile (TLS is on when a listener has a certfile)"
    path = conf("listener 1883 127.0.0.1", "tls_version tlsv1.0")
    assert refusal(path) == f"{path}:2: tls_version: must be one of tlsv1.3, tlsv1.2, tlsv1.1, not 'tlsv1.0'"
    path = conf("listener 1883 127.0.0.1", "protocol mqttsn")
    assert refusal(path) == f"{path}:2: protocol: must be one of mqtt, websockets, not 'mqttsn'"
    path = conf("listener 1883 127.0.0.1", "listener 1883 127.0.0.1")
    assert refusal(path) == f"{path}:2: listener: a second listener on the same port and address (the first: {path}:1)"
    path = conf("listener 1883 127.0.0.1", "use_subject_as_username true")
    assert refusal(path).startswith(f"{path}:2: use_subject_as_username: not supported")


def test_per_listener_settings_puts_security_in_its_listener(conf: Write, tmp_path: Path) -> None:
    pw, acl = tmp_path / "pw", tmp_path / "acl"
    pw.write_text("")
    acl.write_text("")
    path = conf(
        "per_listener_settings true",
        "listener 1883 127.0.0.1",
        "allow_anonymous true",
        "listener 1884 127.0.0.1",
        f"password_file {pw}",
        f"acl_file {acl}",
        "allow_zero_length_clientid false",
    )
    arguments, _ = translate(path)
    specs = [parse_listener(arguments[i + 1]) for i, a in enumerate(arguments) if a == "--listener"]
    assert [(s.port, s.allow_anonymous, s.password_file, s.acl_file) for s in specs] == [
        (1883, True, None, None),
        (1884, False, str(pw), str(acl)),  # Mosquitto 2.0: no allow_anonymous, none let in
    ]
    assert specs[1].allow_zero_length_clientid is False
    assert "--auth-file" not in arguments and "--acl-file" not in arguments


def test_per_listener_settings_refuses_security_outside_the_listeners(conf: Write, tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("")
    path = conf("per_listener_settings true", f"password_file {pw}", "listener 1883 127.0.0.1")
    assert refusal(path).startswith(
        f"{path}:2: password_file: with per_listener_settings true, outside a listener section this is the default"
    )
    # Without a listener section, the default listener is the only one: the server's options.
    arguments, _ = translate(conf("per_listener_settings true", f"password_file {pw}"))
    assert arguments == ["--auth-file", str(pw)]
    # Mosquitto insists on per_listener_settings coming first.
    path = conf("allow_anonymous true", "per_listener_settings true")
    assert refusal(path).startswith(f"{path}:2: per_listener_settings: must come before any password_file")


def test_security_directives_without_per_listener_settings_are_the_whole_servers(conf: Write) -> None:
    path = conf("listener 1883 127.0.0.1", "allow_anonymous true", "allow_zero_length_clientid false")
    arguments, _ = translate(path)
    assert arguments == [
        "--allow-anonymous", "true", "--allow-zero-length-clientid", "false", "--listener", "mqtt://127.0.0.1:1883",
    ]  # fmt: skip


# -- persistence and logging ----------------------------------------------------------------


def test_persistence_is_a_store_beside_mosquittos_never_its_own(conf: Write, tmp_path: Path) -> None:
    (tmp_path / "mosquitto.db").write_bytes(b"\x00\xb5\x00mosquitto db" + b"\x00" * 40)
    path = conf("persistence true", f"persistence_location {tmp_path}/")
    assert translate(path)[0] == ["--persistence", str(tmp_path / PERSISTENCE_FILE)]
    path = conf("persistence true", f"persistence_location {tmp_path}/", "persistence_file mosquitto.db")
    assert refusal(path).startswith(f"{path}:3: persistence_file: {tmp_path}/mosquitto.db is Mosquitto's own database")
    path = conf("persistence true", f"persistence_location {tmp_path}/", "persistence_file state.db")
    assert translate(path)[0] == ["--persistence", str(tmp_path / "state.db")]
    assert translate(conf("persistence false", f"persistence_location {tmp_path}/"))[0] == []
    path = conf("persistence true", f"persistence_location {tmp_path}/absent/")
    assert refusal(path) == f"{path}:2: persistence_location: {tmp_path}/absent/ is not a directory"


def test_log_dest_is_one_log_file(conf: Write, tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    assert translate(conf(f"log_dest file {log}"))[0] == ["--log-file", str(log)]
    assert translate(conf("log_dest stdout"))[0] == ["--log-file", "-"]
    assert translate(conf("log_dest stderr"))[0] == []
    path = conf("log_dest stdout", f"log_dest file {log}")
    arguments, warnings = translate(path)
    assert arguments == ["--log-file", str(log)]
    assert warnings == [f"{path}:2: log_dest: the server logs to one place: the last log_dest's"]
    path = conf(f"log_dest file {tmp_path}/absent/broker.log")
    assert refusal(path).startswith(f"{path}:1: log_dest: cannot write {tmp_path}/absent/broker.log")


# -- the command line -----------------------------------------------------------------------


def test_the_command_line_overrides_the_file(conf: Write) -> None:
    path = conf("max_keepalive 120", "max_qos 1", "pid_file /nonexistent/dir/x.pid", "port 1884")
    argv = ["--max-qos=0", "-c", path, "--pid-file", "/tmp/unused.pid", "--port", "0"]
    expanded, _ = expand_config(argv)
    # What the command line gives is not taken from the file (so neither is its unusable path).
    assert expanded == ["--max-keepalive", "120", "--allow-anonymous", "false", *argv]
    args = parser().parse_args(expanded)
    assert (args.max_keepalive, args.max_qos, args.port, args.config) == (120, 0, 0, path)
    for spelling in (["-c", path], [f"-c{path}"], ["--config", path], [f"--config={path}"]):
        assert expand_config(spelling)[0][:2] == ["--max-keepalive", "120"]
    assert expand_config(["--port", "1"]) == (["--port", "1"], [])


def test_listeners_on_the_command_line_replace_the_files(conf: Write) -> None:
    path = conf("listener 1883 127.0.0.1")
    expanded, warnings = expand_config(["-c", path, "--listener", "mqtt://127.0.0.1:2883"])
    assert expanded.count("--listener") == 1
    assert warnings == [f"{path}:1: listener: the file's listeners are not served: --listener given"]


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servers.heartbeat", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (("max_keepalive 60", "max_keepalive 0"), ":2: max_keepalive: must be a whole number of seconds"),
        (
            ("# bridge", "connection to-cloud", "address 10.0.0.1"),
            ":2: connection: bridge to-cloud has no topic",
        ),
        (("listener 1883 127.0.0.1", "max_keepalivee 5"), ":2: max_keepalivee: unknown directive (did you mean"),
    ],
)
def test_the_cli_refuses_a_bad_file_in_one_line(conf: Write, lines: tuple[str, ...], expected: str) -> None:
    path = conf(*lines)
    done = run_cli("-c", path, "--port", "0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"python -m servers.heartbeat: error: {path}{expected}"), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("missing", [False, True])
def test_a_config_file_that_cannot_be_read_is_refused_naming_the_option(tmp_path: Path, missing: bool) -> None:
    path = tmp_path / "nope.conf" if missing else tmp_path
    done = run_cli("--config", str(path), "--port", "0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    why = "cannot be read" if missing else "is a directory"
    assert done.stderr == f"python -m servers.heartbeat: error: --config: {path} {why}" + (
        " (missing, or no permission)\n" if missing else "\n"
    )


def test_help_lists_the_config_option() -> None:
    text = parser().format_help()
    assert "--config FILE" in text and "-c FILE" in text


def test_the_worked_example_of_the_guide_translates_as_it_says(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "how-to" / "from-mosquitto.md").read_text()
    text = next(b for b in page.split("```text\n") if b.startswith("# /etc/mosquitto/mosquitto.conf"))
    text = text.partition("```")[0]
    for name in ("passwd", "acl", "certs/server.pem", "certs/server.key", "ca_certificates/ca.pem"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    text = text.replace("/etc/mosquitto/", f"{tmp_path}/").replace("/var/lib/mosquitto/", f"{tmp_path}/")
    (tmp_path / "mosquitto.conf").write_text(text)
    arguments, warnings = translate(str(tmp_path / "mosquitto.conf"))
    assert warnings == []
    specs = [parse_listener(arguments[i + 1]) for i, a in enumerate(arguments) if a == "--listener"]
    assert [s.name for s in specs] == ["mqtt://127.0.0.1:1883", "mqtts://:8883", "ws://:9001"]
    assert specs[1].require_certificate and specs[1].use_identity_as_username and specs[2].max_connections == 5000
    args = parser().parse_args(arguments)
    assert (args.allow_anonymous, args.auth_file, args.acl_file) == ("false", f"{tmp_path}/passwd", f"{tmp_path}/acl")
    assert (args.session_expiry, args.max_keepalive, args.log_level) == (172800.0, 300, "INFO")
    assert args.persistence == f"{tmp_path}/idlekeeper.db" and args.connection_messages
    assert (args.presence_prefix, args.status_port) == ("$SYS/presence/", 9100)
