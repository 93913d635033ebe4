"""Brute-force throttling of password checks: the sans-IO throttle against a model, and
the server under a flood of wrong passwords (in-process, real loopback sockets, trio's
clock frozen so that delays are exact and only move when the test moves them)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.presence.event import REFUSED, PresenceEvent
from servers.heartbeat.security.passwords import AuthResult, PasswordFile
from servers.heartbeat.security.throttle import Admission, AuthGate, Throttle, ThrottlePolicy, source_key
from servers.heartbeat.server.lifecycle import HeartbeatServer
from servers.heartbeat.worker import serve_heartbeat

POLICY = ThrottlePolicy(free=5, base=1.0, cap=60.0, forget=900.0)

# -- the policy ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(0, 0.0), (4, 0.0), (5, 1.0), (6, 2.0), (7, 4.0), (10, 32.0), (11, 60.0), (12, 60.0), (10**6, 60.0)],
)
def test_no_delay_for_the_free_failures_then_doubling_to_the_cap(failures: int, delay: float) -> None:
    assert POLICY.delay(failures) == delay


@pytest.mark.parametrize(
    "kw", [{"free": 0}, {"base": 0.0}, {"base": 2.0, "cap": 1.0}, {"cap": 60.0, "forget": 30.0}, {"max_keys": 0}]
)
def test_policy_rejects_nonsense(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ThrottlePolicy(**kw)  # type: ignore[arg-type]


# -- one throttle against a model --------------------------------------------------------


class Model:
    """What a throttle should answer, from each key's failures in a row: a streak ends
    when ``forget`` seconds pass without a failure; with more live streaks than
    ``max_keys``, the one whose last failure is oldest is forgotten."""

    def __init__(self, policy: ThrottlePolicy) -> None:
        self.policy = policy
        self.streaks: dict[str, tuple[int, float]] = {}  # key -> (failures, last), oldest last first

    def _live(self, key: str, now: float) -> tuple[int, float] | None:
        streak = self.streaks.get(key)
        if streak is not None and now - streak[1] >= self.policy.forget:
            return None
        return streak

    def fail(self, key: str, now: float) -> None:
        streak = self._live(key, now)
        count = 1 if streak is None else streak[0] + 1
        self.streaks.pop(key, None)
        if streak is None:
            live = [k for k in self.streaks if self._live(k, now) is not None]
            if len(live) >= self.policy.max_keys:
                del self.streaks[live[0]]
        self.streaks[key] = (count, now)

    def wait(self, key: str, now: float) -> float:
        streak = self._live(key, now)
        if streak is None:
            return 0.0
        return max(0.0, streak[1] + self.policy.delay(streak[0]) - now)

    def failures(self, key: str, now: float) -> int:
        streak = self._live(key, now)
        return 0 if streak is None else streak[0]

    def forgive(self, key: str) -> None:
        self.streaks.pop(key, None)


KEYS = st.sampled_from(["a", "b", "c", "d"])
# 8 and 20 are the cap and the forget time below: exact boundaries get hit.
STEPS = st.sampled_from([0.0, 0.0, 0.0, 0.5, 1.0, 4.0, 8.0, 20.0, 61.0])
OPS = st.lists(st.tuples(st.sampled_from(["fail", "fail", "fail", "wait", "forgive"]), KEYS, STEPS), max_size=60)


@settings(max_examples=500, deadline=None)
@given(ops=OPS, max_keys=st.integers(1, 5), free=st.integers(1, 4))
def test_throttle_matches_the_model(ops: list[tuple[str, str, float]], max_keys: int, free: int) -> None:
    policy = ThrottlePolicy(free=free, base=1.0, cap=8.0, forget=20.0, max_keys=max_keys)
    throttle, model = Throttle(policy), Model(policy)
    now = 0.0
    for op, key, step in ops:
        now += step
        if op == "fail":
            throttle.failed(key, now)
            model.fail(key, now)
        elif op == "forgive":
            throttle.forgive(key)
            model.forgive(key)
        for k in "abcd":
            assert throttle.wait(k, now) == model.wait(k, now), (op, key, now)
            assert throttle.failures(k, now) == model.failures(k, now)
        assert len(throttle) <= max_keys


def test_memory_is_bounded_however_many_keys_fail() -> None:
    throttle = Throttle(ThrottlePolicy(max_keys=1000))
    for i in range(50_000):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", i * 0.001)
        assert len(throttle) <= 1000
    # The most recent failures are the ones remembered.
    assert throttle.failures("10.0.195.79", 50.0) == 1  # i = 49999
    assert "10.0.0.0" not in throttle


def test_forgotten_keys_make_room_before_live_ones_are_evicted() -> None:
    throttle = Throttle(ThrottlePolicy(free=1, forget=900.0, max_keys=3))
    for key in ("old-1", "old-2"):
        throttle.failed(key, 0.0)
    throttle.failed("live", 500.0)
    throttle.failed("new", 950.0)  # old-1 and old-2 were forgotten at 900: "live" stays
    assert throttle.failures("live", 950.0) == 1 and len(throttle) == 2


def test_a_throttled_key_gets_one_check_at_a_time_after_its_delay() -> None:
    throttle = Throttle(POLICY)
    for _ in range(5):
        throttle.failed("k", 0.0)
    assert throttle.wait("k", 0.5) == 0.5
    assert throttle.wait("k", 1.0) == 0.0
    held = throttle.begin("k", 1.0)  # its delay has passed: one check may start
    assert held and throttle.wait("k", 1.0) > 0  # a second one may not, meanwhile
    assert throttle.failed("k", 1.2, held) == 2.0  # it failed: the next delay is twice as long
    assert throttle.wait("k", 1.2) == 2.0
    held = throttle.begin("k", 3.2)
    throttle.release("k", held)  # it passed (a neighbour's right password): others may check
    assert throttle.wait("k", 3.2) == 0.0 and throttle.failures("k", 3.2) == 6


def test_a_hold_expires_by_itself_if_its_outcome_never_comes() -> None:
    throttle = Throttle(POLICY)
    for _ in range(5):
        throttle.failed("k", 0.0)
    assert throttle.begin("k", 1.0)
    assert throttle.wait("k", 1.0 + POLICY.cap) == 0.0


def test_a_check_that_began_unthrottled_does_not_release_another_checks_hold() -> None:
    throttle = Throttle(POLICY)
    for _ in range(4):
        throttle.failed("k", 0.0)
    early = throttle.begin("k", 0.0)  # not throttled yet: holds nothing
    throttle.failed("k", 0.0)  # a concurrent check failed: now it is
    late = throttle.begin("k", 1.0)
    throttle.release("k", early)  # the early check passed
    assert not early and late and throttle.wait("k", 1.0) > 0


# -- the gate: source addresses and usernames --------------------------------------------


def _fail(gate: AuthGate, source: str, user: str, now: float, times: int) -> None:
    for _ in range(times):
        assert gate.admit(source, user, now, known_good=False) is Admission.CHECK
        gate.outcome(source, user, now, False, gate.begin(source, user, now))


def test_a_throttled_source_is_refused_even_with_known_good_credentials() -> None:
    gate = AuthGate(POLICY)
    _fail(gate, "10.0.0.1", "guess", 0.0, 5)
    assert gate.admit("10.0.0.1", "dev", 0.5, known_good=True) is Admission.REFUSE_SOURCE
    assert gate.admit("10.0.0.2", "dev", 0.5, known_good=True) is Admission.ACCEPT
    assert gate.admit("10.0.0.1", "dev", 1.0, known_good=True) is Admission.ACCEPT  # the delay has passed


def test_a_username_under_attack_does_not_lock_out_its_device() -> None:
    gate = AuthGate(POLICY)
    for i in range(5):  # five attackers, one failure each: no source is throttled
        _fail(gate, f"10.0.0.{i}", "dev", 0.0, 1)
    assert gate.users.wait("dev", 0.0) == 1.0
    # The device, whose credentials the server verified before, gets in from anywhere.
    assert gate.admit("192.0.2.7", "dev", 0.1, known_good=True) is Admission.ACCEPT
    # Anything else for "dev" is refused unchecked, and counts against its source.
    assert gate.admit("10.0.0.9", "dev", 0.1, known_good=False) is Admission.REFUSE_USER
    assert gate.sources.failures("10.0.0.9", 0.1) == 1
    # A success forgives the username, never the source.
    now = 1.0
    assert gate.admit("10.0.0.9", "dev", now, known_good=False) is Admission.CHECK
    gate.outcome("10.0.0.9", "dev", now, True, gate.begin("10.0.0.9", "dev", now))
    assert gate.users.failures("dev", now) == 0 and gate.sources.failures("10.0.0.9", now) == 1


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("192.0.2.1", "192.0.2.1"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:ffff:1", "2001:db8::/64"),
        ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("?", "?"),
    ],
)
def test_source_keys_group_an_ipv6_subscriber_by_its_64(host: str, key: str) -> None:
    assert source_key(host) == key


# -- the server, under a flood ------------------------------------------------------------


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Trio's clock stands still unless the test jumps it: a throttle delay is exact,
    whatever the password threads take in real time."""
    return trio.testing.MockClock()


@pytest.fixture(params=["dense", "streams"])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def users_file() -> PasswordFile:
    users = PasswordFile()
    users.set("dev", b"right", iterations=1000)
    users.set("other", b"fine", iterations=1000)
    return users


@asynccontextmanager
async def running(cfg: HeartbeatConfig) -> AsyncIterator[HeartbeatServer]:
    cfg.port = 0
    async with trio.open_nursery() as nursery:
        server: HeartbeatServer = await nursery.start(partial(serve_heartbeat, cfg))
        yield server
        nursery.cancel_scope.cancel()


async def attempt(
    port: int, client_id: str, username: str, password: bytes, source: str = "127.0.0.1", *, stay: bool = False
) -> tuple[int, trio.SocketStream]:
    """A CONNECT from ``source``; its CONNACK's return code (the stream stays open if ``stay``)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    await stream.send_all(encoders.encode_connect(client_id, keep_alive=0, username=username, password=password))
    got = b""
    while len(got) < 4:
        chunk = await stream.receive_some(4 - len(got))
        assert chunk, f"closed without a CONNACK ({got!r})"
        got += chunk
    assert got[:3] == b"\x20\x02\x00"
    if not stay:
        await stream.aclose()
    return got[3], stream


def metric(server: HeartbeatServer, name: str) -> float:
    for family in text_string_to_metric_families(server.metrics().decode()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


async def test_a_flood_of_wrong_passwords_is_slowed_and_others_are_not(
    clock: trio.testing.MockClock, engine: str
) -> None:
    cfg = HeartbeatConfig(auth=users_file(), engine=engine, max_idle=None)
    events: list[PresenceEvent] = []
    cfg.extra_sinks.append(events.append)
    async with running(cfg) as server:
        for i in range(40):  # as fast as the loopback goes
            code, _ = await attempt(server.port, f"guess-{i}", "dev", f"wrong-{i}".encode())
            assert code == AuthResult.BAD_CREDENTIALS  # the same answer, checked or not
        # Five were hashed; the 35 that came while the delay ran were refused unchecked.
        assert metric(server, "heartbeat_auth_failures_total") == 5
        assert metric(server, "heartbeat_auth_checks_total") == 5
        assert metric(server, "heartbeat_auth_throttled_total") == 35
        assert metric(server, "heartbeat_auth_delayed_sources") == 1
        assert metric(server, "heartbeat_auth_source_delay_seconds") == 1.0

        # Meanwhile a device from another address, with its right password, gets in at
        # once: its check is the only one hashed, and nothing waits.
        code, device = await attempt(server.port, "honest", "other", b"fine", source="127.0.0.2", stay=True)
        assert code == 0 and metric(server, "heartbeat_auth_checks_total") == 6
        await device.send_all(encoders.encode_pingreq())
        assert await device.receive_some(2) == encoders.encode_pingresp()

        # Each delay that passes lets one more guess be hashed, and doubles the next delay.
        for expected in (2.0, 4.0, 8.0, 16.0):
            clock.jump(metric(server, "heartbeat_auth_source_delay_seconds"))
            assert metric(server, "heartbeat_auth_delayed_sources") == 0
            checks = metric(server, "heartbeat_auth_checks_total")
            for i in range(3):
                code, _ = await attempt(server.port, f"again-{i}", "dev", b"nope")
                assert code == AuthResult.BAD_CREDENTIALS
            assert metric(server, "heartbeat_auth_checks_total") == checks + 1
            assert metric(server, "heartbeat_auth_source_delay_seconds") == expected
        assert metric(server, "heartbeat_auth_throttled_total") == 35 + 4 * 2
        await device.aclose()
    # Refused unchecked or not, each guess is a refusal on record, and nobody's presence.
    refused = [e for e in events if e.status == REFUSED]
    assert len(refused) == 40 + 4 * 3
    assert all(e.client_id is None and e.detail.startswith("bad-credentials") for e in refused)
    assert [e.client_id for e in events if e.status != REFUSED] == ["honest", "honest"]


async def test_a_device_whose_username_is_attacked_still_connects(clock: trio.testing.MockClock, engine: str) -> None:
    cfg = HeartbeatConfig(auth=users_file(), engine=engine, max_idle=None)
    async with running(cfg) as server:
        code, _ = await attempt(server.port, "dev", "dev", b"right", source="127.0.0.2")
        assert code == 0  # the device has connected once: its credentials are known good
        for i in range(5):  # attackers on five addresses, one guess each at its password
            code, _ = await attempt(server.port, f"x{i}", "dev", b"guess", source=f"127.0.1.{i}")
            assert code == AuthResult.BAD_CREDENTIALS
        checks = server.counters["auth_checks"]
        # The device reconnects while its username's delay runs: accepted, not hashed.
        code, _ = await attempt(server.port, "dev", "dev", b"right", source="127.0.0.2")
        assert code == 0
        # A guess for it from a fresh address is refused unchecked.
        code, _ = await attempt(server.port, "x9", "dev", b"guess", source="127.0.1.9")
        assert code == AuthResult.BAD_CREDENTIALS
        assert metric(server, "heartbeat_auth_failures_total") == 5
        assert metric(server, "heartbeat_auth_cache_hits_total") == 1
        assert metric(server, "heartbeat_auth_checks_total") == checks
        assert metric(server, "heartbeat_auth_throttled_total") == 1
        assert metric(server, "heartbeat_auth_delayed_users") == 1


class SlowFile(PasswordFile):
    """A password file whose checks wait for the test, and which counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.verified: list[str | None] = []

    def verify(self, username: str | None, password: bytes | None) -> AuthResult:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.verified.append(username)
        try:
            assert self.release.wait(10)
            return super().verify(username, password)
        finally:
            with self.lock:
                self.running -= 1


async def wait_until(predicate: object) -> None:
    for _ in range(1000):  # bounded: the server's threads and tasks, not trio's clock
        if predicate():  # type: ignore[operator]
            return
        await trio.lowlevel.checkpoint()
        await trio.to_thread.run_sync(threading.Event().wait, 0.01)
    raise AssertionError("timed out")


async def test_checks_run_off_the_loop_bounded_and_a_burst_is_not_hashed(
    clock: trio.testing.MockClock, engine: str
) -> None:
    users = SlowFile()
    users.set("dev", b"right", iterations=1000)
    cfg = HeartbeatConfig(auth=users, engine=engine, max_idle=None, auth_threads=1)
    async with running(cfg) as server:
        results: list[int] = []

        async def guess(i: int) -> None:
            code, _ = await attempt(server.port, f"burst-{i}", "dev", f"wrong-{i}".encode())
            results.append(code)

        async with trio.open_nursery() as burst:
            for i in range(30):  # all at once, before any failure is counted
                burst.start_soon(guess, i)
            await wait_until(lambda: server.counters["packets_in"] == 30 and users.running >= 1)
            await trio.to_thread.run_sync(threading.Event().wait, 0.2)  # real time for more threads to start
            # One check hashes in its thread; the others wait their turn, not a thread each.
            assert users.running == 1
            assert metric(server, "heartbeat_auth_queue") == 29
            users.release.set()
        assert results == [AuthResult.BAD_CREDENTIALS] * 30
        assert users.most == 1  # never more than --auth-threads at once
        # When their turns came, the source had failed five times: the rest were not hashed.
        assert len(users.verified) == 5
        assert metric(server, "heartbeat_auth_throttled_total") == 25


async def test_a_check_whose_client_hung_up_is_not_hashed(clock: trio.testing.MockClock, engine: str) -> None:
    users = SlowFile()
    users.set("dev", b"right", iterations=1000)
    cfg = HeartbeatConfig(auth=users, engine=engine, max_idle=None, auth_threads=1)
    async with running(cfg) as server:
        async with trio.open_nursery() as nursery:
            first: list[int] = []

            async def hashed() -> None:
                first.append((await attempt(server.port, "first", "dev", b"right", source="127.0.0.2"))[0])

            nursery.start_soon(hashed)
            await wait_until(lambda: users.running == 1)
            quitter = await trio.open_tcp_stream("127.0.0.1", server.port)
            await quitter.send_all(encoders.encode_connect("quitter", keep_alive=0, username="dev", password=b"x"))
            await wait_until(lambda: server.counters["packets_in"] == 2)
            await quitter.aclose()  # it gave up waiting for its CONNACK
            users.release.set()
        assert first == [0]
        await wait_until(lambda: server.counters["auth_abandoned"] == 1)
        assert users.verified == ["dev"]  # the quitter's password was never hashed
