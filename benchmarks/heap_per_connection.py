"""Where an idle connection's bytes go: Python heap per connection, by the line that made it.

    python -m benchmarks.heap_per_connection [--connections 1000] [--kind asgi-ws,mqtt-ws,mqtt-tcp]
                                             [--engine dense] [--top 12]

RSS says how much a connection costs; this says what for. For each ``--kind`` it
serves, in this process, under ``tracemalloc``:

- ``asgi-ws``: ``servers.http`` with ``loadtest.asgi_app:app``, the echo app of
  ``python -m loadtest ws``, each client an open WebSocket it never writes to;
- ``mqtt-ws``: ``servers.heartbeat`` with a WebSocket listener, each client an
  MQTT device over WebSockets (keep-alive 600 s) that has had its CONNACK;
- ``mqtt-tcp``: the same devices over plain TCP.

The clients run in a child process (raw sockets, loopback), so only the server's
side is counted: a snapshot before they connect and one after every one of them is
answered, compared. Printed per connection: the total, the heap grouped by what
holds it (the app's task and coroutine frames, the ASGI scope, wsproto, trio, ours),
and the ``--top`` lines that allocated most. Kernel socket buffers are not on the
heap, and allocator overhead is not counted: RSS (``loadtest ws``) is higher.
"""

from __future__ import annotations

import argparse
import collections
import gc
import linecache
import subprocess
import sys
import tracemalloc
from collections.abc import Sequence
from functools import partial

import trio

from loadtest.asgi_app import app
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.worker import serve_heartbeat
from servers.http.server import HttpConfig, serve_asgi

KINDS = ("asgi-ws", "mqtt-ws", "mqtt-tcp")

# The client: connects when told, waits for every answer, holds until told again.
_CLIENT = r"""
import socket, sys
from servers.heartbeat.mqtt import encoders
port, n, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sys.stdin.readline()
path, proto = (b"/echo", b"") if kind == "asgi-ws" else (b"/mqtt", b"Sec-WebSocket-Protocol: mqtt\r\n")
head = (b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n" + proto + b"\r\n")
def frame(payload):
    mask = b"\x01\x02\x03\x04"
    return bytes([0x82, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    connect = encoders.encode_connect(f"heap-{i}", keep_alive=600)
    s.sendall({"asgi-ws": head, "mqtt-ws": head + frame(connect), "mqtt-tcp": connect}[kind])
    socks.append(s)
def answered(got):
    if kind == "mqtt-tcp":
        return len(got) >= 4  # CONNACK
    head, sep, rest = got.partition(b"\r\n\r\n")
    return bool(sep) and (kind == "asgi-ws" or len(rest) >= 6)  # mqtt-ws: CONNACK in a frame too
for s in socks:
    got = b""
    while not answered(got):
        chunk = s.recv(4096)
        if not chunk:
            raise SystemExit("closed before its answer")
        got += chunk
    if not (got.startswith(b"HTTP/1.1 101 ") or got.startswith(b"\x20")):
        raise SystemExit(f"refused: {got[:40]!r}")
print("ready", flush=True)
sys.stdin.readline()
"""

FRAMES = "coroutine frames of the app's task (the app's, and the server's it awaits through)"
SCOPE = "the ASGI scope (dict, headers, addresses)"
_GROUPS = (
    (SCOPE, ("servers/http/head.py", "h11/", "servers/http/core.py")),
    ("wsproto's frame layer", ("wsproto/",)),
    ("trio: the task, its cancel status and scope, its trap", ("trio/", "<attrs generated methods trio")),
    (FRAMES, ("loadtest/asgi_app.py",)),
)


def _group(filename: str, line: int) -> str:
    text = linecache.getline(filename, line)
    if "await " in text:
        return FRAMES  # a suspended coroutine's frame is allocated where it was called
    if filename.endswith("servers/http/websocket.py") and line in _SCOPE_LINES:
        return SCOPE
    for name, prefixes in _GROUPS:
        if any(p in filename for p in prefixes):
            return name
    return "ours (connection, transport, socket, session, exchange, runner)"


# servers/http/websocket.py makes the WebSocket scope from the HTTP one; its other
# allocations are the exchange's.
_SCOPE_LINES: set[int] = set()


def _scope_lines() -> None:
    import servers.http.websocket as module

    path = module.__file__ or ""
    for number, text in enumerate(linecache.getlines(path), start=1):
        if "scope" in text and ("dict(" in text or '["extensions"]' in text):
            _SCOPE_LINES.add(number)


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/main/", "/idlekeeper/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


async def _measure(kind: str, n: int, engine: str, top: int) -> None:
    async with trio.open_nursery() as nursery:
        if kind == "asgi-ws":
            server = await nursery.start(partial(serve_asgi, app, HttpConfig(port=0, engine=engine)))
            port = server.port
        else:
            tcp, ws = trio.socket.socket(), trio.socket.socket()
            for sock in (tcp, ws):
                await sock.bind(("127.0.0.1", 0))
                sock.listen(4096)
            port = (ws if kind == "mqtt-ws" else tcp).getsockname()[1]
            listeners = [trio.SocketListener(tcp)]
            ws_listeners = [trio.SocketListener(ws)]
            start = partial(serve_heartbeat, HeartbeatConfig(port=0, engine=engine), listeners=listeners)
            await nursery.start(partial(start, ws_listeners=ws_listeners))
        client = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
            [sys.executable, "-c", _CLIENT, str(port), str(n), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdin is not None and client.stdout is not None
        try:
            await trio.sleep(0.5)
            gc.collect()
            before = tracemalloc.take_snapshot()
            client.stdin.write("go\n")
            client.stdin.flush()
            line = await trio.to_thread.run_sync(client.stdout.readline)
            if not line.startswith("ready"):
                raise SystemExit(f"{kind}: the client gave up: {line.strip() or client.wait()}")
            await trio.sleep(1.0)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            client.stdin.write("\n")
            client.stdin.flush()
            client.wait(timeout=30)
        stats = after.compare_to(before, "lineno")
        total = sum(s.size_diff for s in stats)
        groups: collections.Counter[str] = collections.Counter()
        for s in stats:
            frame = s.traceback[0]
            groups[_group(frame.filename, frame.lineno)] += s.size_diff
        print(f"\n{kind} on {engine}: {total / n:,.0f} B of Python heap per idle connection ({n} connections)")
        for name, size in groups.most_common():
            print(f"  {size / n:7,.0f} B  {name}")
        print(f"  the {top} lines that allocated most:")
        for s in stats[:top]:
            frame = s.traceback[0]
            text = linecache.getline(frame.filename, frame.lineno).strip()[:60]
            print(f"  {s.size_diff / n:7,.0f} B  {_short(frame.filename)}:{frame.lineno}  {text}")
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each kind asked for, one after the other, in this process."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.heap_per_connection", description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1000, help="idle connections per kind (default: 1000)")
    p.add_argument("--kind", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    p.add_argument(
        "--engine", choices=("dense", "streams"), default="dense", help="the servers' engine (default: dense)"
    )
    p.add_argument("--top", type=int, default=12, help="allocating lines shown per kind (default: 12)")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not 1 <= args.connections <= 5000:
        p.error(f"kinds are {', '.join(KINDS)}; --connections is 1 to 5000 (the open-file limit holds both ends)")
    _scope_lines()
    tracemalloc.start(1)
    try:
        for kind in kinds:
            trio.run(_measure, kind, args.connections, args.engine, args.top)
    finally:
        tracemalloc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
