"""``python -m benchmarks.listeners``: the several-listeners benchmark (:mod:`.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
