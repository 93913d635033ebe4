"""Reading a file an operator wrote (passwords, ACL, bearer tokens): its text, or one
error naming the file, and the line, that could not be read."""

from __future__ import annotations

import os

__all__ = ["read_utf8"]


def read_utf8(path: str | os.PathLike[str], error: type[Exception]) -> tuple[str, str]:
    """``(name, text)`` of the file at ``path``; ``error("NAME: cannot read (...)")`` or
    ``error("NAME:LINE: not UTF-8")`` if it cannot be had."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise error(f"{name}: cannot read ({exc.strerror or exc})") from None
    try:
        return name, data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{name}:{line}: not UTF-8") from None
