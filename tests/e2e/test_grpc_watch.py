"""A grpc.health.v1 Watch is silent while nothing changes, for as long as its caller keeps it: Envoy's limit on a
silent stream (300 s and more) reset every Watch after it, and the caller got INTERNAL (RST_STREAM), so a Watch opened
before a drain could miss its NOT_SERVING. Other calls keep the limit.

The real server and Envoy behind one port, with envoy.yaml's silence limit shortened to keep the test fast."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from portico.v1 import chat_service_pb2_grpc

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import ADMIN_SOCKET, EnvoyProcess, free_ports, http_manager, load_template, render_config, repo_root
from tests.helpers import bearer, chat_request
from tests.upstream_double import Cue
from tests.upstream_support import upstream_models, upstream_server

SILENCE_SECONDS = 1


@pytest.fixture(scope="module")
async def front_door(double):
    """(port, secret) of Envoy, as envoy.yaml has it but for a 1 s stream_idle_timeout, in front of the server."""
    # Outside pytest's tmp dir: the session's log scan expects a Portico log beside every Envoy log there.
    with tempfile.TemporaryDirectory(prefix="portico-watch-") as run_dir:
        async with upstream_server(Path(run_dir), upstream_models(double.url)) as server:
            _, secret = await server.store.create("watch", all_models=True)
            port, admin_port = free_ports(2)
            config = render_config(load_template(), listen_port=port, admin_port=admin_port,
                                   upstreams=[f"127.0.0.1:{server.port}"], admin_socket=Path(run_dir, ADMIN_SOCKET),
                                   descriptor_set=DESCRIPTOR_SET,
                                   lua_dir=repo_root() / "gateway" / "lua",
                                   stream_idle_timeout_s=SILENCE_SECONDS)
            assert http_manager(config)["stream_idle_timeout"] == f"{SILENCE_SECONDS}s"
            async with EnvoyProcess(config, Path(run_dir)):
                yield port, secret


async def test_a_health_watch_outlives_envoys_silence_limit(front_door):
    port, _ = front_door
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(SILENCE_SECONDS * 3)
        assert not watch.done(), await watch.code()
        watch.cancel()


async def test_other_silent_calls_keep_the_limit(front_door, double):
    port, secret = front_door
    double.cue(Cue(delay=SILENCE_SECONDS * 6))
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        chat = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError):
            await chat.CreateChatCompletion(chat_request(model="up-solo"), metadata=bearer(secret),
                                            timeout=SILENCE_SECONDS * 5)
    assert time.monotonic() - started < SILENCE_SECONDS * 3  # cut by Envoy, not by the caller's deadline


async def test_a_caller_queued_for_the_embedded_model_is_silent_and_keeps_the_limit(front_door):
    # configuration.md, embedded.instances: a waiting caller gets no byte until its turn, so Envoy's silence limit
    # bounds the wait (a 504), while the stream that holds the instance goes on; the next caller is served.
    port, secret = front_door
    url, headers = f"http://127.0.0.1:{port}/v1/chat/completions", {"Authorization": f"Bearer {secret}"}

    def body(max_tokens: int) -> dict:
        return {"model": "embedded", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}

    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url, json=body(2000), headers=headers) as running:
            chunks = running.aiter_lines()
            assert running.status_code == 200 and (await anext(chunks)).startswith("data: ")
            started = time.monotonic()
            queued = await client.post(url, json=body(2), headers=headers)
            assert time.monotonic() - started < SILENCE_SECONDS * 3
            assert (queued.status_code, queued.json()["error"]["code"]) == (504, "upstream_timeout")
            assert (await anext(chunks)) is not None  # the running answer was not cut
        # The instance is free once the server has seen the stream's caller leave and stopped it at its next token,
        # which a loaded machine can take longer than this test's 1 s silence limit to do: then a 504 again.
        deadline = time.monotonic() + 15
        while (after := await client.post(url, json={**body(2), "stream": False}, headers=headers)).status_code \
                == 504 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
