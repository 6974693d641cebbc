"""In-process grpc.aio server on 127.0.0.1:0 with the real embedded model and a real SQLite key store."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from portico.v1 import chat_service_pb2_grpc, message_service_pb2_grpc
from server.app import RunningServer, start_server
from server.config import load_config
from server.domain_keys import KeyLimits


@pytest.fixture(scope="session")
async def running(tmp_path_factory) -> RunningServer:
    data_dir = tmp_path_factory.mktemp("data")
    config = dataclasses.replace(load_config(), data_dir=data_dir, access_log=str(data_dir / "access.log"))
    server = await start_server(config, "127.0.0.1:0")
    yield server
    await server.stop(0)


@pytest.fixture
async def key(running: RunningServer, double) -> tuple[str, str]:
    """(key id, secret) of a fresh key for the module's upstream double, whose requests and cues start empty."""
    double.reset()
    key, secret = await running.store.create("upstream-tests", all_models=True, limits=KeyLimits(tokens_per_minute=10**6))
    return key.id, secret


@pytest.fixture(scope="session")
async def secret(running: RunningServer) -> str:
    return (await running.store.create("service-tests", all_models=True))[1]


@pytest.fixture(scope="session")
async def admin_secret(running: RunningServer) -> str:
    return (await running.store.create("service-admin", all_models=True, admin=True))[1]


@pytest.fixture(scope="module")
async def channel(running: RunningServer) -> grpc.aio.Channel:
    """To the module's server: the session's, or the one a module makes with its own `running` (upstream tests)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def chat(channel: grpc.aio.Channel) -> chat_service_pb2_grpc.ChatServiceStub:
    return chat_service_pb2_grpc.ChatServiceStub(channel)


@pytest.fixture(scope="module")
def messages(channel: grpc.aio.Channel) -> message_service_pb2_grpc.MessageServiceStub:
    return message_service_pb2_grpc.MessageServiceStub(channel)
