"""The tests' real Mosquitto: the rule for when it is missing (skip with a reason; in
CI, which installs it, fail), as :mod:`tests.redis_server` has for Redis."""

from __future__ import annotations

import os

import pytest

from loadtest.mqtt_targets import mosquitto_binary

__all__ = ["require_mosquitto"]


def require_mosquitto() -> str:
    """The mosquitto binary; otherwise skip the test (or fail it in CI, which installs it)."""
    binary = mosquitto_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed (.ci/run installs it with apt-get)")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run does it in CI)")
    return binary
