"""Fixtures shared by every suite."""

from __future__ import annotations

import gc
import os

import pytest

from tests.llama_server import LlamaServer, start_llama_server
from tests.postgres_support import PASSWORD_ENV, PostgresServer, start_postgres
from tests.redis_support import RedisServer, start_redis
from tests.upstream_double import UpstreamDouble


@pytest.fixture
def no_collector_pauses():
    """For a test that times the gateway in this process: late in the suite the test process holds ~500,000
    objects, and a full collection of them paused it for 0.3-0.7 s (measured on 2 busy cores), which a timing
    assertion counts against the gateway (the likeliest cause of a CI run's cache miss timed at 1.0 s against its
    0.5 s timeout, which no run here repeated). Collected before, not during."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """A private PostgreSQL cluster; its password is in the environment variable PASSWORD_ENV (as a deployment's
    would be), which `portico serve` processes started by the tests inherit."""
    server = start_postgres()
    os.environ[PASSWORD_ENV] = server.password
    yield server
    server.destroy()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database for one test: its URL (without the password)."""
    return postgres_server.new_database()


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory) -> LlamaServer:
    """`python -m llama_cpp.server` serving the embedded model file: a real OpenAI-compatible upstream."""
    server = start_llama_server(tmp_path_factory.mktemp("llama-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def double() -> UpstreamDouble:
    """A real local HTTP upstream that speaks both dialects and fails on cue; one per test module."""
    double = UpstreamDouble().start()
    yield double
    double.stop()


@pytest.fixture(scope="module")
def other_double() -> UpstreamDouble:
    """A second one, for a model served by two upstreams (deployments)."""
    double = UpstreamDouble().start()
    yield double
    double.stop()
