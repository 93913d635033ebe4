"""``python -m benchmarks.core``: the core benchmark (:mod:`.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
