"""The HTTP server through the faults operators see, with clients at work.

    python -m benchmarks.http_faults [--clients 30] [--phase 3]

Starts ``servers.http`` with two workers serving :mod:`loadtest.background_app` (its
``/bg`` leaves work running after each response, as a FastAPI background task does),
and keeps ``--clients`` keep-alive clients busy throughout, each alternating ``/`` and
``/bg?s=0.5`` and checking every answer. Then, one ``--phase`` of seconds each:

1. **calm**: nothing happens; every request must be answered;
2. **stall**: a worker is SIGSTOPped for the phase, then SIGCONTed: its clients wait,
   none is answered wrongly or cut;
3. **kill a worker**: SIGKILL; only its connections break (their clients reconnect),
   the supervisor starts another, and every request after is answered;
4. **hostile input**: malformed heads, oversized heads and bodies, a slowloris, from
   other connections: each gets its 400, 431, 413 or 408, the clients nothing wrong;
5. **kill the supervisor**: SIGKILL; both workers exit within 5 s (they never outlive it).

Each phase's requests, errors (cut connections), wrong answers and slow answers (over
1 s) are printed, with PASS or FAIL. Loopback only; every process is stopped by its PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import psutil

from loadtest.processes import free_port, start_http, stop

PHASES = ("calm", "stall", "kill a worker", "hostile input")


@dataclass
class Tally:
    """What the clients saw in one phase."""

    ok: int = 0
    errors: int = 0
    wrong: int = 0
    slow: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *, ok: int = 0, errors: int = 0, wrong: int = 0, slow: int = 0) -> None:
        with self.lock:
            self.ok += ok
            self.errors += errors
            self.wrong += wrong
            self.slow += slow


class Clients:
    """Keep-alive clients alternating ``/`` and ``/bg``, counting into the current phase."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.tallies = {name: Tally() for name in PHASES}
        self.phase = PHASES[0]
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(count)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=10)

    def _client(self) -> None:
        sock: socket.socket | None = None
        turn = 0
        while not self.stopping.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                target = b"/" if turn % 2 else b"/bg?s=0.5"
                turn += 1
                started = time.monotonic()
                sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: drill\r\n\r\n")
                answer = _response(sock)
                took = time.monotonic() - started
                # Counted in the phase it ends in: a request the stall held is the stall's.
                tally = self.tallies[self.phase]
                if answer == b"hello\n":
                    tally.add(ok=1, slow=int(took > 1.0))
                else:
                    tally.add(wrong=1)
            except OSError:
                self.tallies[self.phase].add(errors=1)
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.05)
        if sock is not None:
            sock.close()


def _response(sock: socket.socket) -> bytes:
    """The body of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed")
        body += chunk
    return body[:length]


def _hostile(port: int, seconds: float) -> dict[bytes, int]:
    """Bad requests from their own connections for ``seconds``: the status lines they got."""
    attacks = [
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 40_000 + b"\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ]
    got: dict[bytes, int] = {}
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET / HTTP/1.1\r\n")  # a slowloris: the rest never comes
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            try:
                sock.sendall(attacks[i % len(attacks)])
                line = sock.recv(64).split(b"\r\n")[0]
            except OSError:
                line = b"(cut)"
            got[line] = got.get(line, 0) + 1
        i += 1
        time.sleep(0.02)
    slow.settimeout(15)
    try:
        got[b"slowloris: " + slow.recv(64).split(b"\r\n")[0]] = 1
    except OSError:
        got[b"slowloris: (cut)"] = 1
    slow.close()
    return got


def _workers(supervisor: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(supervisor).children() if "servers.http" in " ".join(p.cmdline())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=30, help="keep-alive clients (default: 30)")
    parser.add_argument("--phase", type=float, default=3.0, help="seconds a phase (default: 3)")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 500:
        parser.error(f"--clients {args.clients}: 1 to 500")
    if not 1.0 <= args.phase <= 60.0:
        parser.error(f"--phase {args.phase}: 1 to 60 seconds")
    port = free_port()
    extra = ["loadtest.background_app:app", "--grace", "2", "--header-timeout", "2", "--max-header-size", "16384"]
    extra += ["--max-body-size", "1048576", "--tick", "0.05"]
    server = start_http(port, 2, extra)
    clients = Clients(port, args.clients)
    verdicts: list[bool] = []
    try:
        clients.start()
        time.sleep(args.phase)  # calm
        victim = _workers(server.pid)[0]
        clients.phase = "stall"
        victim.send_signal(signal.SIGSTOP)
        time.sleep(args.phase)
        victim.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        clients.phase = "kill a worker"
        _workers(server.pid)[0].send_signal(signal.SIGKILL)
        time.sleep(args.phase)
        clients.phase = "hostile input"
        hostile = _hostile(port, args.phase)
    finally:
        clients.stop()
    for name in PHASES:
        t = clients.tallies[name]
        ok = t.ok > 0 and t.wrong == 0 and (t.errors == 0 or name == "kill a worker")
        if name == "kill a worker":
            ok = ok and t.errors <= args.clients  # at most each client's connection once
        verdicts.append(ok)
        print(f"{name:<15} answered {t.ok:>6}  cut {t.errors:>4}  wrong {t.wrong:>3}  over 1 s {t.slow:>4}  "
              f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    expected = (b"HTTP/1.1 400", b"HTTP/1.1 431", b"HTTP/1.1 413", b"slowloris: HTTP/1.1 408")
    answered = all(any(line.startswith(e) for line in hostile) for e in expected)
    print(
        f"{'  their answers':<15} "
        + ", ".join(f"{k.decode(errors='replace')}: {v}" for k, v in sorted(hostile.items()))
    )
    verdicts.append(answered)
    workers = _workers(server.pid)
    os.kill(server.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(workers, timeout=5)
    gone = not alive
    verdicts.append(gone)
    print(f"{'kill the supervisor':<15} {len(workers)} workers, {len(alive)} still running after 5 s  "
          f"{'PASS' if gone else 'FAIL'}")  # fmt: skip
    for proc in alive:
        proc.kill()
    stop(server)
    print("result", "PASS" if all(verdicts) else "FAIL")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
