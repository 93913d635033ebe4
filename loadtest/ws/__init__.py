"""``python -m loadtest ws``: WebSockets on ``servers.http`` beside uvicorn[standard] and
hypercorn on the same ASGI app, and MQTT over WebSockets beside Mosquitto. The command is
:mod:`.cli`; the wire (frames), opening connections, the servers, each part (idle, echo,
dead, slow, mqtt), the workload and the report are modules here."""

from __future__ import annotations

from .cli import main, run_mqtt, run_ws

__all__ = ["main", "run_mqtt", "run_ws"]
