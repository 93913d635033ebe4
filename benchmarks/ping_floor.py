"""The least a Python server can spend on a heartbeat: a bare ``epoll`` loop that
answers CONNECT with CONNACK and PINGREQ with PINGRESP, and nothing else.

    python -m benchmarks.ping_floor --port PORT [--host 127.0.0.1]

No keep-alive, no deadline, no session, no presence: it is not a server anyone should
run, but the floor under any Python one. ``benchmarks.wakeups --floor`` and
``benchmarks.instructions --floor`` drive it as they drive ``servers.heartbeat``, so
the part of a heartbeat's cost that is the interpreter's and the kernel's can be told
from the part that is ours. It expects each packet to arrive whole (as a benchmark's
two-byte PINGREQs do on loopback), says it listens on stderr as the servers do, and stops
on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import select
import signal
import socket
import sys
from collections.abc import Sequence

PINGREQ, PINGRESP = b"\xc0\x00", b"\xd0\x00"
CONNACK = b"\x20\x02\x00\x00"
CONNECT_TYPE = 0x10


def serve(listener: socket.socket) -> None:
    """Answer every connection of ``listener`` until interrupted."""
    listener.setblocking(False)
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    # A signal wakes the wait through this socket, as trio's loop is woken: under
    # valgrind an interrupted epoll_wait can be restarted, and SIGTERM never seen.
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    poller.register(wake_r.fileno(), select.EPOLLIN)
    clients: dict[int, socket.socket] = {}
    lfd, wake = listener.fileno(), wake_r.fileno()
    while True:
        for fd, _ in poller.poll(-1, 64):
            if fd == lfd:
                _accept_all(listener, poller, clients)
                continue
            if fd == wake:  # a signal whose handler did not raise
                wake_r.recv(64)
                continue
            sock = clients[fd]
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data == PINGREQ:
                sock.send(PINGRESP)
            elif data and data[0] == CONNECT_TYPE:
                sock.send(CONNACK)
            elif not data:
                poller.unregister(fd)
                del clients[fd]
                sock.close()


def _accept_all(listener: socket.socket, poller: select.epoll, clients: dict[int, socket.socket]) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        clients[sock.fileno()] = sock
        poller.register(sock.fileno(), select.EPOLLIN)


def main(argv: Sequence[str] | None = None) -> int:
    """Listen on ``--port`` and serve until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ping_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (default: 127.0.0.1)")
    args, _ = p.parse_known_args(argv)  # the options given to servers.heartbeat are ignored
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    listener.listen(4096)
    # The line loadtest.processes.start_server waits for (servers.readiness).
    print(f"ping_floor worker 0: listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        serve(listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
