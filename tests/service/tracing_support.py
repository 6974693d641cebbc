"""What the tracing tests share: a real OTLP/HTTP receiver, a traced server on the upstream double, and helpers
to ask with a caller's traceparent and find the spans of its trace."""

from __future__ import annotations

import asyncio
import os
import secrets

import orjson
import pytest

from server.app import start_server
from server.config import load_config
from tests.helpers import bearer, chat_request
from tests.otlp_receiver import OtlpReceiver
from tests.upstream_support import (
    UPSTREAM_KEY, UPSTREAM_KEY_ENV, cross_dialect_models, upstream_models, write_config,
)

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello."
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


def traced_config(directory, models_yaml: str, tracing: str):
    path = write_config(directory, models_yaml)
    path.write_text(f"tracing: {tracing}\naccess_log: {directory / 'access.log'}\n" + path.read_text())
    return load_config(path)


def pair(url: str) -> str:
    """A model on two deployments, the one nearly always picked first being down."""
    provider = f"kind: openai, api_key_env: {UPSTREAM_KEY_ENV}, model: pair-model, retry: {{attempts: 1}}"
    return f"""\
  - id: up-pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: dead, weight: 1000, provider: {{{provider}, base_url: 'http://127.0.0.1:9/v1'}}}}
      - {{name: live, weight: 1, provider: {{{provider}, base_url: '{url}'}}}}
"""


@pytest.fixture(scope="module")
async def running(double, receiver, tmp_path_factory):
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    tracing = f"{{otlp_endpoint: '{receiver.url}', export_delay_seconds: 0.05}}"
    images = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: image-up"
    cached = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: cached-model"
    models = (upstream_models(double.url)
              + cross_dialect_models(double.url, openai_model="gpt-up", anthropic_model="claude-up")
              + f"  - {{id: images-up, endpoint: /v1/images/generations, provider: {{{images}}}}}\n"
              + "  - {id: images-dev, endpoint: /v1/images/generations, provider: {kind: dev-image}}\n"
              + pair(double.url)
              + f"  - {{id: up-cached, endpoint: {CHAT}, provider: {{{cached}}}, cache: {{}}}}\n")
    config = traced_config(tmp_path_factory.mktemp("traced"), models, tracing)
    server = await start_server(config, "127.0.0.1:0")
    yield server
    await server.stop(0)
    os.environ.pop(UPSTREAM_KEY_ENV, None)


def caller_context(sampled: bool = True) -> tuple[str, str, tuple[str, str]]:
    """(trace id, span id, the traceparent metadata pair) of a caller's own span."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, ("traceparent", f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}")


async def ask(chat, secret: str, traceparent, model: str = "up-main", **fields):
    metadata = (*bearer(secret), traceparent)
    return await chat.CreateChatCompletion(chat_request(model=model, messages=HELLO, **fields), metadata=metadata)


async def spans_of(receiver: OtlpReceiver, trace_id: str) -> list:
    """The trace's spans once its request span arrived; waiting in a thread, so the server (on this loop) runs."""
    return await asyncio.to_thread(receiver.wait_for_trace, trace_id)


def one(spans, **match):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def access_line(running, trace_id: str) -> dict:
    with open(running.telemetry.access_log.target, encoding="utf-8") as log:
        lines = [orjson.loads(line) for line in log]
    (line,) = [line for line in lines if line["trace_id"] == trace_id]
    return line
