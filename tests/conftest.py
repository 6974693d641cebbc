"""Fixtures shared by every suite."""

from __future__ import annotations

import pytest

from tests.redis_support import RedisServer, start_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
