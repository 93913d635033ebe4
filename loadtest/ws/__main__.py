"""``python -m loadtest.ws``: the same as ``python -m loadtest ws`` (:mod:`.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
