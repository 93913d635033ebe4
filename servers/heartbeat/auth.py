"""Manage a password file: add, remove or check a user.

    python -m servers.heartbeat.auth add FILE USER      # password on stdin
    python -m servers.heartbeat.auth remove FILE USER
    python -m servers.heartbeat.auth check FILE USER    # exit 0 if accepted

The file's forms of hash (ours, and Mosquitto's ``$7$`` and ``$6$``) and how a check
costs what it does are :mod:`.security.passwords`'.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .security.passwords import DEFAULT_ITERATIONS, AuthFileError, AuthResult, PasswordFile

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m servers.heartbeat.auth``: manage a password file."""
    p = argparse.ArgumentParser(prog="python -m servers.heartbeat.auth", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("add", "add or replace USER; the password is read from stdin"),
        ("remove", "remove USER"),
        ("check", "check USER's password from stdin; exit 0 if accepted, 1 if not"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("file")
        cmd.add_argument("username")
        if name == "add":
            cmd.add_argument(
                "--iterations",
                type=int,
                default=DEFAULT_ITERATIONS,
                help=f"PBKDF2-HMAC-SHA256 rounds (default: {DEFAULT_ITERATIONS})",
            )
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
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
