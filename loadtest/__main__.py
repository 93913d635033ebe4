"""``python -m loadtest <command>``: device load, HTTP load, and side-by-side comparisons.

python -m loadtest devices --devices 200000 --stall     MQTT devices against servers.heartbeat
python -m loadtest http --slowloris 500                  HTTP load with slowloris and slow readers
python -m loadtest compare                               the same workloads against the peers
python -m loadtest qos                                   QoS 1 throughput and queued-message memory vs Mosquitto
python -m loadtest demo                                  the main job (also: make demo)
python -m loadtest fleet --nodes 3 --kill-node           gateways sharing presence through Redis
python -m loadtest tls                                   MQTT over TLS: memory per connection, handshakes/s vs Mosquitto
python -m loadtest fuzz --target both --inputs 200000    hostile input against both servers, judged
python -m loadtest abuse                                 issue 33's attacks with a healthy fleet beside them, judged
python -m loadtest ws                                    WebSockets vs uvicorn and hypercorn; MQTT over WS vs Mosquitto
python -m loadtest history presence.jsonl ...            check presence logs: one start and one end per session
python -m loadtest page --devices 100000 --watchers 10   what ten live operator's pages cost a loaded server
python -m loadtest scorecard --rounds 2                  the speed and memory targets against the peers, judged
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from servers.extras import MissingExtra, require

from .options import MODULE, program, version_line

COMMANDS = {
    "devices": "loadtest.devices",
    "http": "loadtest.http.load",
    "compare": "loadtest.compare",
    "demo": "loadtest.demo",
    "fleet": "loadtest.fleet",
    "qos": "loadtest.qos",
    "tls": "loadtest.tls_load",
    "fuzz": "loadtest.fuzz",
    "abuse": "loadtest.abuse",
    "ws": "loadtest.ws",
    "history": "loadtest.history_cli",
    "page": "loadtest.page",
    "scorecard": "loadtest.scorecard",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command's ``main``; its exit code (the console script ``idlekeeper-loadtest``).

    Usage errors raise :class:`SystemExit` (2) from the command's parser, as argparse does.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    prog = program()
    if args[:1] == ["--version"]:
        print(version_line())
        return 0
    if args[:1] in (["-h"], ["--help"]):
        print((__doc__ or "").replace(MODULE, prog))
        return 0
    if not args:
        print((__doc__ or "").replace(MODULE, prog), file=sys.stderr)
        return 2
    if args[0] not in COMMANDS:
        print(f"{prog}: error: no command {args[0]!r} (commands: {', '.join(COMMANDS)}; see --help)", file=sys.stderr)
        return 2
    # Before the command's import: without the extra, that import (or the plots at the
    # end of a long run) would die on a module the operator never asked for.
    try:
        require(f"{prog} {args[0]}", "loadtest")
    except MissingExtra as exc:
        return int(exc.code or 2)
    module = importlib.import_module(COMMANDS[args[0]])
    code: int = module.main(args[1:])
    return code


if __name__ == "__main__":
    sys.exit(main())
