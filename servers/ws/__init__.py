"""WebSockets for the servers (issue 29), sans-IO over wsproto, h11's sibling: the
opening handshake's checks (:mod:`.upgrade`) and policy (:mod:`.handshake`), an
ASGI WebSocket's messages (:mod:`.session`, :mod:`.deflate`) and MQTT carried in
binary frames (:mod:`.mqtt_transport`). Bytes in, bytes and events out; the servers' connection
loops do the I/O."""
