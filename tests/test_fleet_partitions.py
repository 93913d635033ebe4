"""Network partitions of a fleet (issue 32), made with a network namespace and veth
pairs (:mod:`loadtest.partition`): gateway ``gw0`` lives in an island that reaches
Redis over one link and is reached by its devices over another; ``gw1`` and Redis are
on the host. Either link is cut (its packets silently dropped, both ends up) with
devices connected, connecting, leaving and roaming, then healed; presence must end
every session exactly once, and show no device online at two gateways for longer than
the lease (:mod:`loadtest.history`).

What presence says meanwhile:

- **gw0 cut off from Redis**, its devices still connected: once its lease lapses,
  ``gw1`` declares it lost and ends its sessions (``node-lost``). When the link heals,
  ``gw0`` registers again and closes the connections whose sessions were ended
  (fenced): their devices reconnect as new sessions. A device that connected to ``gw0``
  during the cut comes online then.
- **gw0's devices cut off**, gw0 still reaching Redis: their sessions end by keep-alive
  timeout, or by takeover for those that reconnected to ``gw1`` first.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.device_results import read_presence_log
from loadtest.history import check_history, merged_by_time
from loadtest.partition import Island, partitions_possible
from loadtest.processes import free_port, start_heartbeat
from loadtest.redis_server import RedisServer
from servers.heartbeat.mqtt import encoders

from .redis_server import require_binary
from .test_fleet_faults import ROOT, get
from .test_fleet_sentinel import metric
from .test_heartbeat_clients import subscriber
from .test_presence_faults import heard, until

LEASE = 3.0
KEEP_ALIVE = 3

why_not = partitions_possible()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not is not None, reason=f"no partitions here: {why_not}")]


def connect(host: str, port: int, client_id: str, keep_alive: int = KEEP_ALIVE) -> socket.socket:
    """A device past its CONNACK, at ``host``."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(encoders.encode_connect(client_id, keep_alive=keep_alive))
    assert sock.recv(4) == encoders.encode_connack(False, 0)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> None:
    """Wait for the server to close ``sock``, reading past its PINGRESPs; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return
        except ConnectionResetError:
            return
        except TimeoutError:
            break
    raise AssertionError(f"the connection was not closed within {seconds} s")


class Pinger:
    """Pings every device given to it each second, as its MQTT client would; a socket
    whose send fails (cut, or closed) is left alone."""

    def __init__(self) -> None:
        self.socks: dict[str, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks.values():
            sock.close()

    def _run(self) -> None:
        for _ in range(600):  # bounded: ten minutes at most
            if self._stop.wait(1.0):
                return
            for sock in list(self.socks.values()):
                # Sent only: the PINGRESPs (2 bytes a second) wait in the socket for
                # whoever reads it, as a recv here would wait for its socket's timeout.
                with contextlib.suppress(OSError):
                    sock.send(encoders.encode_pingreq(), socket.MSG_DONTWAIT)


Gateway = tuple[subprocess.Popen[str], str, int, int, Path]
"""A gateway: its process, address, MQTT port, status port and presence log."""
Setting = tuple[Island, RedisServer, list[Gateway]]


@pytest.fixture
def setting(tmp_path: Path) -> Iterator[Setting]:
    require_binary()
    place = Island()
    gateways: list[Gateway] = []
    redis: RedisServer | None = None
    try:
        place.make()
        # Reached from the island too; protected mode refuses all but loopback clients
        # without a password, and these addresses are loopback and a veth pair's.
        redis = RedisServer(extra=["--bind", "127.0.0.1", place.host_backend, "--protected-mode", "no"])
        redis.start()
        for name, host, redis_host, prefix in (
            ("gw0", place.address, place.host_backend, place.prefix),
            ("gw1", "127.0.0.1", "127.0.0.1", []),
        ):
            port, status = free_port(), free_port()
            log = tmp_path / f"{name}.jsonl"
            args = ["--cluster", f"redis://{redis_host}:{redis.port}/0", "--node", name, "--presence-log", str(log)]
            args += ["--tick", "0.05", "--status-port", str(status), "--lease", str(LEASE)]
            args += ["--host", host, "--status-host", host]
            proc = start_heartbeat(port, 1, args, cwd=str(ROOT), prefix=prefix, log=tmp_path / f"{name}.log")
            gateways.append((proc, host, port, status, log))
        yield place, redis, gateways
    finally:
        for proc, *_ in gateways:
            if proc.poll() is None:
                proc.kill()  # by PID
                proc.wait()
        if redis is not None:
            redis.stop()
        place.remove()


@contextlib.contextmanager
def explained(gateways: list[Gateway]) -> Iterator[None]:
    """A failed assertion comes with the end of each gateway's log (its stderr): the
    run's temporary directory may be gone before anyone reads it."""
    try:
        yield
    except AssertionError as exc:
        tails = []
        for *_, presence in gateways:
            log = presence.with_suffix(".log")
            lines = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log)"]
            tails.append(f"--- {log.name}, its last 40 lines:\n" + "\n".join(lines[-40:]))
        raise AssertionError("\n".join([str(exc), *tails])) from exc


def stop_and_check(gateways: list[Gateway], at_least: int) -> None:
    for proc, *_ in gateways:
        proc.send_signal(signal.SIGTERM)
    for proc, *_ in gateways:
        assert proc.wait(timeout=20) == 0
    merged = merged_by_time(*(read_presence_log(log) or [] for *_, log in gateways))
    history = check_history(merged, lease=LEASE * 2)
    assert history.ok, history.summary()
    assert history.devices >= at_least, history.summary()


def devices_on_both(
    pinger: Pinger, gateways: list[Gateway], on_gw0: int, on_gw1: int
) -> tuple[socket.socket, list[tuple[str, dict[str, object]]], dict[str, socket.socket], dict[str, socket.socket]]:
    """A dashboard on gw1, then ``a-<i>`` devices on gw0 and ``b-<i>`` on gw1, pinged,
    once the dashboard heard every one come online."""
    (_, host0, port0, _, _), (_, _, port1, _, _) = gateways
    watch, got = subscriber(port1, "dashboard", "$SYS/presence/#")
    time.sleep(0.3)
    on0 = {f"a-{i}": connect(host0, port0, f"a-{i}") for i in range(on_gw0)}
    on1 = {f"b-{i}": connect("127.0.0.1", port1, f"b-{i}") for i in range(on_gw1)}
    pinger.socks.update(on0 | on1)
    until(lambda: heard(got, "online") >= set(on0) | set(on1), 15, "the dashboard hears both gateways")
    return watch, got, on0, on1


def test_a_gateway_cut_off_from_redis_is_declared_lost_and_fences_its_sessions_when_healed(
    setting: Setting,
) -> None:
    place, _, gateways = setting
    (_, host0, port0, status0, _), (_, _, port1, status1, _) = gateways
    with explained(gateways), Pinger() as pinger:
        watch, got, on0, on1 = devices_on_both(pinger, gateways, 15, 15)

        place.cut("backend")
        try:
            # While cut off: a device leaves gw0, another connects to it, a third roams to gw1.
            on0["a-2"].sendall(encoders.encode_disconnect())
            pinger.socks.pop("a-2")
            pinger.socks["island-new"] = connect(host0, port0, "island-new")
            roamer = pinger.socks["a-1"] = connect("127.0.0.1", port1, "a-1")
            until(lambda: "a-1" in heard(got, "online"), 10, "the roamer online at gw1")
            until(lambda: heard(got, "offline", "node-lost") >= set(on0) - {"a-1"}, 20, "gw0 declared lost")
            _, body = get(f"http://127.0.0.1:{status1}/devices/a-5")
            assert b'"node-lost"' in body, body
        finally:
            place.heal("backend")

        # gw0 registers again, closes the connections whose sessions were ended, and
        # announces the one that came meanwhile. Within a second or two: over a new
        # connection to Redis, not the stalled one, whose TCP backoff had grown to
        # many seconds during the cut (tests/test_fleet_link.py).
        for client_id in sorted(set(on0) - {"a-1", "a-2"}):
            closed_within(on0[client_id], 15)  # still pinged: closed by the gateway, not by keep-alive
            pinger.socks.pop(client_id, None)
        closed_within(on0["a-1"], 15)  # a newer session holds it, at gw1
        until(lambda: "island-new" in heard(got, "online"), 15, "the device that came during the cut")
        assert metric(status0, "heartbeat_fleet_fenced_total", host0) >= 12
        back = {f"a-{i}": connect(host0, port0, f"a-{i}") for i in range(3, 6)}  # they reconnect
        pinger.socks.update(back)
        until(lambda: sum(1 for t, e in list(got) if t.endswith("/a-3") and e["status"] == "online") == 2, 10, "a-3")
        assert not heard(got, "offline") & set(on1), "a device of gw1 went offline"
        ends = Counter((t, e["epoch"]) for t, e in list(got) if e["status"] == "offline")
        assert all(n == 1 for n in ends.values()), ends
        assert roamer.fileno() >= 0
        watch.close()
    stop_and_check(gateways, 31)


def test_a_gateways_devices_cut_off_end_by_keep_alive_or_takeover_once_each(
    setting: Setting,
) -> None:
    place, _, gateways = setting
    _, (_, _, port1, status1, _) = gateways
    with explained(gateways), Pinger() as pinger:
        watch, got, on0, on1 = devices_on_both(pinger, gateways, 16, 10)

        place.cut("devices")
        try:
            # Half of gw0's devices find another way in at once (a phone changing networks).
            roamers = {f"a-{i}" for i in range(0, 16, 2)}
            for client_id in roamers:
                pinger.socks[client_id] = connect("127.0.0.1", port1, client_id)
            stayers = set(on0) - roamers
            until(lambda: heard(got, "offline", "takeover") >= roamers, 10, "the roamers' old sessions taken over")
            until(lambda: heard(got, "offline", "keepalive-timeout") >= stayers, 15, "the others time out")
            _, body = get(f"http://127.0.0.1:{status1}/devices/a-1")
            assert b'"keepalive-timeout"' in body, body
            _, body = get(f"http://127.0.0.1:{status1}/devices/a-0")
            assert b'"online"' in body, body
        finally:
            place.heal("devices")

        time.sleep(1.0)  # anything late would come now
        ends = Counter((t, e["epoch"]) for t, e in list(got) if e["status"] == "offline")
        assert all(n == 1 for n in ends.values()), ends
        assert len(ends) == 16, ends
        assert not heard(got, "offline") & set(on1), "a device of gw1 went offline"
        watch.close()
    stop_and_check(gateways, 27)
