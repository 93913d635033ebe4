"""The MQTT presence server on idlekeeper: MQTT 3.1, 3.1.1 and 5.0 over TCP, TLS and
WebSockets, keep-alive kept by the timing wheel, telling which devices are alive and
which died, on one box or a Redis fleet. Run it with ``python -m servers.heartbeat``."""
