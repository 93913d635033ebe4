"""The supervisor (servers.workers.supervise) with real child processes.

It sleeps until something happens: a worker's exit (a pidfd), a line for the hub, a
signal, or a restart coming due. These tests run it in the main thread (it installs
signal handlers) while a helper thread kills workers and finally sends SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from servers import workers
from servers.workers import supervise

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and SIGKILL semantics: Linux")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _children() -> list[psutil.Process]:
    """The supervisor's live workers: other children of this process (a multiprocessing
    resource tracker left by an earlier test, say) are not theirs to count or kill."""
    found = []
    for p in psutil.Process().children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cmdline() == SLEEPER:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def _run(script: Callable[[], None], count: int, **kwargs: object) -> tuple[int, BaseException | None]:
    """Run supervise here while ``script`` runs in a thread; the script ends it with SIGTERM."""
    failure: list[BaseException] = []

    def driver() -> None:
        try:
            script()
        except BaseException as exc:  # reported by the test, not lost in the thread
            failure.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        code = supervise(lambda index: SLEEPER, count, grace=5.0, **kwargs)  # type: ignore[arg-type]
    finally:
        thread.join(timeout=30)
    return code, failure[0] if failure else None


def test_a_killed_worker_is_restarted_at_once_and_sigterm_stops_all() -> None:
    pids: list[int] = []
    seen: dict[str, float] = {}

    def script() -> None:
        assert _wait_for(lambda: len(_children()) == 2, 10), "two workers did not start"
        first = {p.pid for p in _children()}
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        assert _wait_for(lambda: len({p.pid for p in _children()} - first) == 1, 5), "no new worker"
        seen["restart"] = time.monotonic() - killed
        pids.extend(p.pid for p in _children())

    started = time.monotonic()
    code, failure = _run(script, 2, restart_backoff=0.0)
    if failure is not None:
        raise failure
    assert code == 0
    # Noticed through its pidfd, not a poll; with no back-off due the restart follows at once.
    assert seen["restart"] < 1.0
    assert len(pids) == 2
    # SIGTERM reached every worker and the supervisor returned well within its grace.
    assert time.monotonic() - started < 15
    assert not _children()


def test_the_supervisor_sleeps_while_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    wakeups = 0
    wait = workers._Waiter.wait

    def counted(self: workers._Waiter, timeout: float) -> None:
        nonlocal wakeups
        wakeups += 1
        wait(self, timeout)

    monkeypatch.setattr(workers._Waiter, "wait", counted)
    counts: dict[str, int] = {}

    def script() -> None:
        assert _wait_for(lambda: len(_children()) == 3, 10)
        before = wakeups
        time.sleep(2.0)
        counts["idle"] = wakeups - before

    code, failure = _run(script, 3)
    if failure is not None:
        raise failure
    assert code == 0
    # At most one look around a second (the old loop polled every 50 ms: 40 in 2 s).
    assert counts["idle"] <= 3, counts


def test_without_pidfds_it_polls_and_still_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    seen: dict[str, float] = {}

    def script() -> None:
        assert _wait_for(lambda: len(_children()) == 1, 10)
        (only,) = _children()
        os.kill(only.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert _wait_for(lambda: [p.pid for p in _children()] not in ([], [only.pid]), 5)
        seen["restart"] = time.monotonic() - killed

    code, failure = _run(script, 1, restart_backoff=0.0)
    if failure is not None:
        raise failure
    assert code == 0
    assert seen["restart"] < 1.0


def test_a_worker_that_cannot_start_stops_the_supervisor_at_once() -> None:
    """Exit 3 (a taken port, an app whose start-up failed) cannot pass with a retry:
    the supervisor stops every worker and exits 3, not restart it for ever."""
    failing = [sys.executable, "-c", f"import sys; sys.exit({workers.CANNOT_START})"]
    started = time.monotonic()
    code = supervise(lambda index: failing if index == 1 else SLEEPER, 2, grace=5.0, restart_backoff=0.0)
    assert code == workers.CANNOT_START
    assert time.monotonic() - started < 10
    assert not _children()  # the healthy worker was stopped too


def test_a_worker_that_keeps_failing_at_start_is_given_up_after_a_bounded_number_of_tries() -> None:
    starts: list[int] = []

    def command(index: int) -> list[str]:
        starts.append(index)
        return [sys.executable, "-c", "import sys; sys.exit(1)"]

    code = supervise(command, 1, grace=5.0, restart_backoff=0.0)
    assert code == 1
    assert len(starts) == workers.START_TRIES
