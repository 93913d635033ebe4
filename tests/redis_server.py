"""The tests' real Redis: :class:`loadtest.redis_server.RedisServer`, and the rule
for when it is missing (skip with a reason; in CI, which installs it, fail)."""

from __future__ import annotations

import os

import pytest

from loadtest.redis_server import RedisServer, redis_server_binary, running_redis

__all__ = ["RedisServer", "require_binary", "running_redis"]


def require_binary() -> str:
    """The redis-server binary; otherwise skip the test (or fail it in CI, which installs it)."""
    binary = redis_server_binary()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed (.ci/run installs it with apt-get)")
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it in CI)")
    return binary
