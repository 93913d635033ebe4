"""``python -m loadtest.generator SPEC.json``: one device-generator process (:mod:`.loop`)."""

from __future__ import annotations

import sys

from .loop import main

if __name__ == "__main__":
    sys.exit(main())
