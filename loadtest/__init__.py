"""The load tests: MQTT devices, HTTP clients and attackers, QoS and TLS clients driving idlekeeper's
servers (and their peers) as real clients do; ``python -m loadtest`` lists the commands."""
