"""The bridge's runtime (issue 64): a bridge to another MQTT broker, running.

:class:`~.runtime.Bridge` runs one :class:`~..bridge.BridgeSpec`: a client session
to this server's own listener over loopback and one to the remote broker, the
messages forwarded each way with their acknowledgements chained (a QoS 1/2 message
is acknowledged to the broker it came from only once the other acknowledged its
copy), the remote's connection watched by the worker's keeper and connected again
with the spec's backoff, and Mosquitto's connection notifications. :mod:`.side` holds
one side's connection and opens the remote's (TCP or TLS); :mod:`.start` starts a
worker's bridges beside its listeners, in a fleet each at the one gateway holding its
duty (:meth:`~..coordination.Coordinator.duty`).

May import: every room below the worker's (:mod:`..bridge`, :mod:`..mqtt`), trio and
idlekeeper. Nothing below imports it: the worker starts it.
"""

from .runtime import LOCAL_SESSION_EXPIRY, WINDOW, Bridge
from .start import FLEET_HOSTNAME, NoPlainListener, announcer, local_address, on_duty, start_bridges

__all__ = [
    "LOCAL_SESSION_EXPIRY",
    "WINDOW",
    "FLEET_HOSTNAME",
    "Bridge",
    "NoPlainListener",
    "announcer",
    "local_address",
    "on_duty",
    "start_bridges",
]
