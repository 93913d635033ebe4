"""The bridge measured against Mosquitto's (issue 64): ``python -m benchmarks.bridge``.

    python -m benchmarks.bridge [--qos0 20000] [--qos1 5000] [--keepalive 2] [--json FILE]

A remote Mosquitto on loopback, and an edge bridging ``bench/# out 1`` to it: this
server with ``--bridge``, or a second Mosquitto with a ``connection`` section, the same
settings for both (``keepalive_interval K``, ``restart_timeout 1``). Side by side:

- **throughput**: N messages published on the edge as fast as it takes them (QoS 1:
  a window of PUBLISHes in flight), timed from the first publish to the last arrival
  at a subscriber on the remote; what never arrived is lost;
- **a stopped remote**: the remote SIGSTOPped, seconds until each edge's local
  ``$SYS/broker/connection/<remote_clientid>/state`` says ``0``; then SIGCONT, and
  seconds until a probe published on the edge arrives at the remote;
- **a remote restarted under load**: QoS 1 at a steady rate while the remote (with
  persistence, autosaved each second) is SIGKILLed and started again; its subscriber
  has a persistent session and comes back; every message must arrive.

Every process is started here and stopped by its PID; every wait is bounded.
"""
