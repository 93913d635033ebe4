"""Imported first by the dense engine (:mod:`idlekeeper.engine`): it needs Linux's
``epoll`` and per-packet receive timestamps (``recvmsg`` ancillary data), and says so
in one clear error where they are missing, rather than an ``AttributeError`` from deep
in an import. The rest of the package (the keeper, watches, ``serve_tcp``) runs
wherever trio runs."""

from __future__ import annotations

import select
import socket
import sys

__all__: list[str] = []

_MISSING = [
    name
    for name, there in (
        ("select.epoll", hasattr(select, "epoll")),
        ("socket.CMSG_SPACE", hasattr(socket, "CMSG_SPACE")),
    )
    if not there
]
if _MISSING or not sys.platform.startswith("linux"):
    raise ImportError(
        "idlekeeper's dense engine (Engine, open_engine, serve_protocol) needs Linux "
        f"(epoll and receive timestamps; {sys.platform} lacks {', '.join(_MISSING) or 'them'}); "
        "the keeper, Keeper.watch and serve_tcp work on any platform trio runs on"
    )
