"""WebSockets for the servers (issue 29), sans-IO over wsproto, h11's sibling: the
opening handshake's policy (:mod:`.handshake`) and MQTT carried in binary frames
(:mod:`.mqtt_transport`). Bytes in, bytes and events out; the servers' connection
loops do the I/O."""
