"""The kernel checks behind stall safety, on real loopback sockets."""

from __future__ import annotations

import socket

from idlekeeper.stall import send_would_progress, unread_bytes


def pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return server, client


def test_unread_bytes_counts_what_the_kernel_holds() -> None:
    server, client = pair()
    try:
        assert unread_bytes(server) == 0
        client.sendall(b"hello")
        # Loopback delivery is synchronous, but allow the kernel a moment.
        server.settimeout(1)
        server.recv(0)
        assert unread_bytes(server) == 5
        assert server.recv(5) == b"hello"
        assert unread_bytes(server) == 0
    finally:
        server.close()
        client.close()
    assert unread_bytes(server) == 0  # closed: fileno -1


def test_send_would_progress_tracks_the_peer_reading() -> None:
    server, client = pair()
    try:
        assert send_would_progress(server)
        server.setblocking(False)
        sent = 0
        try:
            while True:
                sent += server.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert sent > 0
        assert not send_would_progress(server)  # peer stopped reading: buffer full
        client.setblocking(False)
        drained = 0
        try:
            while drained < sent:
                drained += len(client.recv(1 << 20))
        except BlockingIOError:
            pass
        assert send_would_progress(server)  # peer read: room again
    finally:
        server.close()
        client.close()
    assert not send_would_progress(server)
