"""A caller who leaves a stream after the upstream reported its prompt but before its first content (a gRPC stream
cancelled or past its deadline, a REST client that disconnects): the upstream has taken the prompt, and bills it,
so the request is counted with the prompt tokens it reported (api.md, Rate limits: "whose caller left before the
first token counts, and its tokens are what the model reported"), in the usage ledger, the spend and the limits."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from portico.v1 import message_service_pb2_grpc
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_caller_gone_unary import admin, key, leave, reached, rows, standing
from tests.helpers import bearer, message_request
from tests.upstream_double import Cue
from tests.upstream_echo import echo_messages
from tests.upstream_support import UPSTREAM_KEY_ENV

PROMPT = [{"role": "user", "content": "Say hello to the whole world"}]
PROMPT_TOKENS = 1234  # what the upstream's message_start reports: not the gateway's estimate of PROMPT
INPUT_PRICE = 3  # dollars per million tokens: a prompt token costs 3 micro-dollars


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    anthropic = f"kind: anthropic, base_url: '{double.url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    models = f"""\
  - {{id: messages-up, endpoint: /v1/messages, provider: {{{anthropic}, model: m, retry: {{attempts: 1}}}},
      price: {{input: {INPUT_PRICE}, output: 7}}}}
"""
    with upstream_gateway(tmp_path_factory.mktemp("caller-gone-streams"), models) as gateway:
        yield gateway


def slow_content(double) -> None:
    """message_start (with the prompt's usage) at once, the first content seconds later."""
    frames = echo_messages({"model": "m", "stream": True, "max_tokens": 16, "messages": PROMPT})
    frames[0] = re.sub(rb'"input_tokens":\d+', f'"input_tokens":{PROMPT_TOKENS}'.encode(), frames[0])
    double.reset()
    double.cue(Cue(frames=frames, frame_delay=3.0))


def wait_for_the_prompts_usage(double) -> None:
    deadline = time.monotonic() + 10
    while not reached(double)():
        assert time.monotonic() < deadline, "the request never reached the upstream"
        time.sleep(0.01)
    time.sleep(0.5)  # message_start, sent with the status line, is in the gateway by then


@pytest.mark.parametrize("how", ["grpc cancel", "grpc deadline", "rest disconnect"])
def test_a_caller_gone_before_the_first_content_is_counted_with_the_prompt_the_upstream_reported(
        gateway, double, how):
    slow_content(double)
    key_id, secret = key(gateway, f"gone-{how}")
    headers = admin(gateway)
    if how == "rest disconnect":
        # No answer's headers before the first content (they would commit its status): the caller leaves unanswered.
        leave(f"{gateway.base_url}/v1/messages", {"model": "messages-up", "max_tokens": 16, "stream": True,
                                                  "messages": PROMPT},
              {"x-api-key": secret}, once=lambda: wait_for_the_prompts_usage(double) or True)
    else:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = message_service_pb2_grpc.MessageServiceStub(channel)
            timeout = 30 if how == "grpc cancel" else 1.0
            stream = stub.StreamMessage(message_request(model="messages-up", max_tokens=16, messages=PROMPT),
                                        metadata=bearer(secret), timeout=timeout)
            wait_for_the_prompts_usage(double)
            if how == "grpc cancel":
                stream.cancel()
            with pytest.raises(grpc.RpcError) as raised:
                next(stream)
            assert raised.value.code() is (grpc.StatusCode.CANCELLED if how == "grpc cancel"
                                           else grpc.StatusCode.DEADLINE_EXCEEDED)
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"]) == (499, "cancelled")
    assert (row["input_tokens"], row["output_tokens"]) == (PROMPT_TOKENS, 0), row
    assert row["cost_microdollars"] == PROMPT_TOKENS * INPUT_PRICE, row
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["daily_tokens"] == PROMPT_TOKENS, used


def test_a_stream_that_breaks_after_its_upstream_reported_the_prompt_counts_that_prompt(gateway, double):
    """api.md, Rate limits: one that failed upstream (a 502) counts, "and its tokens are what the model reported":
    message_start's prompt count, then the connection drops before any content, and no retry is left."""
    double.reset()
    frames = echo_messages({"model": "m", "stream": True, "max_tokens": 16, "messages": PROMPT})
    frames[0] = re.sub(rb'"input_tokens":\d+', f'"input_tokens":{PROMPT_TOKENS}'.encode(), frames[0])
    double.cue(Cue(frames=frames, drop_after=1))
    key_id, secret = key(gateway, "broken-after-start")
    headers = admin(gateway)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = message_service_pb2_grpc.MessageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            next(stub.StreamMessage(message_request(model="messages-up", max_tokens=16, messages=PROMPT),
                                    metadata=bearer(secret), timeout=30))
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    (row,) = rows(gateway, key_id, headers)
    assert row["status"] == 502, row
    assert (row["input_tokens"], row["output_tokens"]) == (PROMPT_TOKENS, 0), row
    assert row["cost_microdollars"] == PROMPT_TOKENS * INPUT_PRICE, row
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["daily_tokens"] == PROMPT_TOKENS, used
