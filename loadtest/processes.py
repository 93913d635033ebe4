"""Starting the servers under test as processes of their own, and waiting until they listen."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from servers.readiness import find_ready
from servers.workers import module_command

from .report import plural

__all__ = [
    "CpuSplit",
    "free_port",
    "load_side",
    "pin",
    "split_cpus",
    "start_heartbeat",
    "start_http",
    "start_server",
    "stop",
    "wait_listening",
]


def _port_slice() -> range:
    """The ports :func:`free_port` hands out in this process.

    They lie below the kernel's ephemeral range: a port picked there (by binding to 0)
    can be taken, before the server binds it, as the source port of any outgoing
    connection, and a test suite makes thousands. Processes that run side by side
    (pytest-xdist workers, told apart by ``PYTEST_XDIST_WORKER``) take disjoint slices,
    so two of them never hand out the same port.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low, high = 10000, max(ephemeral, 20000)
    worker, workers = 0, 1
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if name.startswith("gw") and name[2:].isdigit():
        worker = int(name[2:])
        workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), worker + 1)
    size = (high - low) // workers
    return range(low + worker * size, low + (worker + 1) * size)


_PORTS = _port_slice()
# A walk through the slice from a random place: a port is handed out again only after
# the whole slice, so calls made before any server binds (three sentinels, say) differ.
_next_port = [random.randrange(len(_PORTS))]


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEADDR, so a port some old connection still holds in TIME_WAIT is
    # passed over too: not every peer server binds with it.
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", run: int = 1) -> int:
    """A free port on ``host`` (the server takes it right after); with ``run`` > 1, the
    first of that many consecutive free ports (workers serve status on port + i).

    The ports come from outside the kernel's ephemeral range (see :func:`_port_slice`),
    so no outgoing connection takes one between this call and the server's bind.
    """
    for _ in range(len(_PORTS)):
        index = _next_port[0] % len(_PORTS)
        _next_port[0] = index + run
        if index + run > len(_PORTS):
            continue  # the run would leave the slice
        first = _PORTS[index]
        if all(_bindable(host, first + offset) for offset in range(run)):
            return first
    raise RuntimeError(f"no run of {run} free ports found in {_PORTS.start}-{_PORTS.stop - 1}")


def start_heartbeat(
    port: int,
    workers: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 20.0,
    cwd: str | None = None,
    prefix: Sequence[str] = (),
    log: Path | None = None,
) -> subprocess.Popen[str]:
    """Run ``python -m servers.heartbeat`` on ``port``; see :func:`start_server`."""
    return start_server("heartbeat", port, workers, extra, timeout, cwd, prefix=prefix, log=log)


def start_http(
    port: int,
    workers: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 20.0,
    cwd: str | None = None,
    log: Path | None = None,
) -> subprocess.Popen[str]:
    """Run ``python -m servers.http`` on ``port``; see :func:`start_server`."""
    return start_server("http", port, workers, extra, timeout, cwd, log=log)


def start_server(
    name: str,
    port: int,
    workers: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 20.0,
    cwd: str | None = None,
    module: str | None = None,
    prefix: Sequence[str] = (),
    log: Path | None = None,
) -> subprocess.Popen[str]:
    """Run ``python -m servers.<name>`` (or ``module``) on ``port``; return once every worker listens.

    ``prefix`` goes before the command (``ip netns exec NS``, which execs it: the PID is
    still the server's).

    Its stderr keeps being drained by a thread, so the server never blocks on it; with
    ``log``, every line of it is written there too, as it comes (to read after a fault).
    Stop it with ``send_signal(SIGTERM)`` on the returned process (by PID).
    """
    module = module or f"servers.{name}"
    cmd = [*prefix, *module_command(module), "--port", str(port), "--workers", str(workers), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stderr is not None
    # One thread reads stderr for the server's whole life (so it never blocks on a full
    # pipe) and hands lines over; waiting on the queue keeps the timeout real even if
    # a worker never says it listens.
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        with contextlib.ExitStack() as stack:
            out = None if log is None else stack.enter_context(log.open("a", buffering=1))
            for line in proc.stderr:
                if out is not None:
                    out.write(line)  # first: a line start_server has read is in the log too
                lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    ready = 0
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while ready < workers and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not line:
            break
        seen.append(line.rstrip())
        ready += len(find_ready(line, name))  # lines from several workers may have run together
    if ready < workers:
        code = proc.poll()
        why = f"it exited with {code}" if code is not None else f"none within {timeout:g} s"
        proc.kill()
        proc.wait()
        tail = "\n".join(seen[-10:])
        raise RuntimeError(f"{module} did not start ({ready} of {plural(workers, 'worker')} listening; {why}):\n{tail}")
    return proc


def wait_listening(
    port: int, proc: subprocess.Popen[bytes] | subprocess.Popen[str], host: str = "127.0.0.1", timeout: float = 30.0
) -> None:
    """Return once something accepts TCP connections on ``host:port``.

    For peers that print no "listening" line. Raises if ``proc`` exits first or
    ``timeout`` passes.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on {host}:{port} within {timeout} s")


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 15.0) -> int:
    """SIGTERM ``proc`` by its PID, SIGKILL it if it has not exited after ``timeout``; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class CpuSplit:
    """CPUs for the server under test and CPUs for what loads it, kept apart.

    On a two-core machine, a load generator and the server it measures otherwise take
    turns on both cores, and whichever is scheduled where changes from one run to the
    next: the server's throughput then moves with the scheduler. Pinned apart, each
    server is measured on one core of its own, and its peers on the same core.
    """

    def __init__(self, server: set[int], load: set[int]) -> None:
        self.server = server
        """CPUs for the server's processes."""
        self.load = load
        """CPUs for the load (this process, its threads and the tools it starts)."""

    def __repr__(self) -> str:
        return f"server on CPU {sorted(self.server)}, load on CPU {sorted(self.load)}"


def split_cpus() -> CpuSplit | None:
    """The last CPU this process may use for the server, the rest for the load; None
    where there are fewer than two (or affinity is not supported)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cpus) < 2:
        return None
    return CpuSplit({cpus[-1]}, set(cpus[:-1]))


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Pin every thread of each process to ``cpus`` (threads started later inherit it
    from theirs); a process or thread that is gone is skipped."""
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            threads = [pid]
        for tid in threads:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def load_side(split: CpuSplit | None) -> Iterator[None]:
    """Run the block (and the threads and processes it starts) on the load's CPUs, then
    return this thread to where it was."""
    if split is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, split.load)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
