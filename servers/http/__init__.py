"""HTTP/1.1 server on h11 and idlekeeper. Run it with ``python -m servers.http``."""
