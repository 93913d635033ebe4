"""Manage a password file: add, remove or check a user.

    idlekeeper-passwd add FILE USER      # password on stdin
    idlekeeper-passwd remove FILE USER
    idlekeeper-passwd check FILE USER    # exit 0 if accepted

(``python -m servers.heartbeat.auth`` in a checkout.)

The file's forms of hash (ours, and Mosquitto's ``$7$`` and ``$6$``) and how a check
costs what it does are :mod:`.security.passwords`'.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..settings import CommandLine, Setting, count, program
from .security.passwords import DEFAULT_ITERATIONS, AuthFileError, AuthResult, PasswordFile

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m servers.heartbeat.auth``: manage a password file."""
    p = CommandLine(prog=program("idlekeeper-passwd", "servers.heartbeat.auth"), description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("add", "add or replace USER; the password is read from stdin"),
        ("remove", "remove USER"),
        ("check", "check USER's password from stdin; exit 0 if accepted, 1 if not"),
    ):
        cmd: CommandLine = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("file", help="the password file (made if missing)")
        cmd.add_argument("username")
        if name == "add":
            rounds = f"PBKDF2-HMAC-SHA256 rounds (default: {DEFAULT_ITERATIONS})"
            cmd.add_settings([Setting("--iterations", count("rounds"), DEFAULT_ITERATIONS, rounds)])
    args = p.parse_args(argv)
    try:
        users = PasswordFile.load(args.file) if os.path.exists(args.file) else PasswordFile()
        if args.command == "add":
            password = sys.stdin.readline().rstrip("\r\n").encode()
            users.set(args.username, password, iterations=args.iterations)
            users.save(args.file)
            return 0
        if args.command == "remove":
            if not users.remove(args.username):
                print(f"no user {args.username!r}", file=sys.stderr)
                return 1
            users.save(args.file)
            return 0
        password = sys.stdin.readline().rstrip("\r\n").encode()
        return 0 if users.check(args.username, password) is AuthResult.ACCEPTED else 1
    except (AuthFileError, OSError, ValueError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
