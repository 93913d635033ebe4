"""``python -m loadtest http``: keep-alive load on an HTTP server, alone and beside slowloris
and slow-reader attackers. The command is :mod:`.load`; the workload, the targets, the
load generator and the attackers are modules here (``compare`` uses them too)."""
