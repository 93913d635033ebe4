"""The engines that carry a connection's bytes to the server and back: the dense
engine's callbacks (:mod:`.dense`, the default, and :mod:`.dense_ws` for WebSockets) or
a trio task per connection (:mod:`.streams`, with :mod:`.websocket`). Each feeds the
sans-IO reader and session and calls the server's steps (:mod:`..server`).

May import: everything below it in the package (:mod:`..server` and what it imports).
Only the worker (:mod:`..worker`) imports it.
"""
