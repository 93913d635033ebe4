"""MQTT 5.0 on the wire, beside the 3.1.1 codec: reason codes, properties, packets and
their codec, all sans-IO (bytes in, values out, and back)."""
