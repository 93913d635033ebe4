"""MQTT 3.1.1 keep-alive presence server on idlekeeper. Run it with ``python -m servers.heartbeat``."""
