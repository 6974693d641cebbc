"""Error `code`s that applications branch on, through the whole stack with the official SDKs and gRPC stubs: an
OpenAI-compatible upstream's own code on its 4xx (`context_length_exceeded`, `content_policy_violation`), an Anthropic
upstream's "prompt is too long", and Portico's own refusal of a prompt over the embedded model's context window, in
each dialect's words (api.md, Errors)."""

from __future__ import annotations

import os
import re

import anthropic
import grpc
import openai
import pytest

from portico.client import BadRequestError, PorticoClient
from portico.v1 import chat_service_pb2_grpc
from tests.e2e.conftest import running_gateway
from tests.e2e.test_operations import access_lines
from tests.helpers import bearer, chat_request, error_details
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV

WINDOW = 512  # the embedded model's context window here: a prompt of ~1,000 tokens does not fit
LONG = [{"role": "user", "content": "hello " * 1000}]
HI = [{"role": "user", "content": "Say hello."}]
OPENAI_CONTEXT = {"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages "
                            "resulted in 8227 tokens. Please reduce the length of the messages.",
                            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
ANTHROPIC_CONTEXT = {"type": "error", "error": {"type": "invalid_request_error",
                                                "message": "prompt is too long: 209353 tokens > 199999 maximum"}}


def upstream_error(code, *, message: str = "The upstream refuses this.", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    directory = tmp_path_factory.mktemp("error-codes")
    openai_up = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up"
    claude_up = (f"kind: anthropic, base_url: '{double.url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}, "
                 "model: claude-up")
    rows = [("chat-up", "/v1/chat/completions", openai_up), ("chat-claude", "/v1/chat/completions", claude_up),
            ("messages-up", "/v1/messages", openai_up),
            ("messages-claude", "/v1/messages", claude_up), ("image-up", "/v1/images/generations", openai_up),
            ("chat-embedded", "/v1/chat/completions", "kind: llamacpp"),
            ("messages-embedded", "/v1/messages", "kind: llamacpp")]
    models = "".join(f"  - {{id: {i}, endpoint: {e}, provider: {{{p}, retry: {{attempts: 1}}}}}}\n"
                     if "llamacpp" not in p else f"  - {{id: {i}, endpoint: {e}, provider: {{{p}}}}}\n"
                     for i, e, p in rows)
    config = directory / "portico.yaml"
    config.write_text(f"data_dir: {directory / 'data'}\nembedded: {{context_size: {WINDOW}}}\nmodels:\n{models}")
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        with running_gateway(directory / "data", config=config) as gateway:
            yield gateway
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("code", "param"), [("context_length_exceeded", "messages"),
                                             ("unsupported_parameter", "reasoning_effort"),
                                             ("invalid_value", "temperature")])
def test_an_openai_upstreams_code_reaches_the_openai_sdk(oai, double, code, param, stream):
    """LangChain, LlamaIndex and agent frameworks catch `context_length_exceeded` to trim history and try again: it
    was `invalid_request` for every upstream 400."""
    double.cue(Cue(status=400, body=upstream_error(code, param=param)))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-up", messages=HI, max_tokens=4, stream=stream)
    error = caught.value
    assert (error.status_code, error.code, error.type, error.param) == (400, code, "invalid_request_error", param)
    assert error.message.endswith("The upstream refuses this.")


def test_an_openai_upstreams_context_error_in_its_stream_keeps_its_code(oai, double):
    """The same error reported as the stream's first event (OpenAI's in-stream error object), before any content."""
    frame = (b'data: {"error": {"message": "too long", "type": "invalid_request_error", '
             b'"code": "context_length_exceeded"}}\n\n')
    double.cue(Cue(frames=[frame]))
    with pytest.raises(openai.BadRequestError) as caught:
        list(oai.chat.completions.create(model="chat-up", messages=HI, max_tokens=4, stream=True))
    assert caught.value.code == "context_length_exceeded"


def test_an_image_upstreams_content_policy_code_reaches_the_openai_sdk(oai, double):
    double.cue(Cue(status=400, body=upstream_error("content_policy_violation", param="prompt")))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.images.generate(model="image-up", prompt="something refused")
    assert (caught.value.code, caught.value.param) == ("content_policy_violation", "prompt")


@pytest.mark.parametrize("code", [400, "400", "Context Length", "context-length", "x" * 65, "model_not_found",
                                  "invalid_api_key", None])
def test_an_upstream_code_that_is_no_plain_identifier_or_names_another_row_is_not_passed_on(oai, double, code):
    """A number (vLLM's `"code": 400`), free text, or a code of another row of the table (a 400 `model_not_found`
    about the upstream's name for the model would say the caller's model is unknown): the table's code."""
    double.cue(Cue(status=400, body=upstream_error(code)))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-up", messages=HI, max_tokens=4)
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize("status", [409, 422])
def test_the_other_upstream_4xx_that_are_400s_keep_their_code_too(oai, double, status):
    double.cue(Cue(status=status, body=upstream_error("string_above_max_length", param="messages[0].content")))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-up", messages=HI, max_tokens=4)
    assert caught.value.code == "string_above_max_length"


@pytest.mark.parametrize(("status", "row"), [(500, "upstream_error"), (503, "service_unavailable"),
                                             (429, "rate_limit_exceeded"), (413, "request_too_large")])
def test_an_upstream_code_never_replaces_another_rows_code(gateway, double, status, row):
    double.cue(Cue(status=status, body=upstream_error("context_length_exceeded")))
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="chat-up", messages=HI, max_tokens=4)
    assert caught.value.code == row


def test_grpc_callers_find_the_upstreams_code_in_the_status_details(gateway, double):
    double.cue(Cue(status=400, body=OPENAI_CONTEXT))
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateChatCompletion(chat_request(model="chat-up"), metadata=bearer(gateway.secret))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code, detail.error.param) == (400, "context_length_exceeded", "messages")


VLLM_CONTEXT = {"error": {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                          "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 "
                                     "tokens (4000 in the messages, 1000 in the completion). Please reduce the length "
                                     "of the messages or completion."}}


@pytest.mark.parametrize("model", ["chat-up", "messages-up"])
def test_vllms_context_window_refusal_is_context_length_exceeded(oai, claude, double, model):
    """vLLM says it in OpenAI's words but with `"code": 400`: its callers got `invalid_request`, where an Anthropic
    upstream's, OpenAI's and Portico's own refusal say `context_length_exceeded`."""
    double.cue(Cue(status=400, body=VLLM_CONTEXT))
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        if model == "chat-up":
            oai.chat.completions.create(model=model, messages=HI, max_tokens=4)
        else:
            claude.messages.create(model=model, max_tokens=4, messages=HI)
    error = caught.value.body if model == "chat-up" else caught.value.body["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    assert error["message"].startswith("This model's maximum context length is 4096 tokens.")


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_upstreams_prompt_too_long_is_context_length_exceeded_for_chat_callers(oai, double, stream):
    double.cue(Cue(status=400, body=ANTHROPIC_CONTEXT))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HI, max_tokens=4, stream=stream)
    error = caught.value
    assert (error.code, error.param, error.type) == ("context_length_exceeded", "messages", "invalid_request_error")
    assert "prompt is too long: 209353 tokens > 199999 maximum" in error.message


def test_an_anthropic_upstreams_prompt_too_long_reaches_anthropic_sdk_callers_as_it_was(claude, double):
    double.cue(Cue(status=400, body=ANTHROPIC_CONTEXT))
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="messages-claude", max_tokens=4, messages=HI)
    error = caught.value.body["error"]
    assert (error["type"], error["message"]) == ("invalid_request_error", ANTHROPIC_CONTEXT["error"]["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_embedded_models_window_is_openais_context_length_exceeded(oai, gateway, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-embedded", messages=LONG, max_tokens=4, stream=stream)
    error = caught.value
    assert (error.code, error.param, error.type) == ("context_length_exceeded", "messages", "invalid_request_error")
    assert f"This model's maximum context length is {WINDOW} tokens" in error.message
    # Logs, the ledger and metrics keep the row's code: a bounded set of labels.
    line = [line for line in access_lines(gateway) if line.get("model") == "chat-embedded"][-1]
    assert (line["status"], line["code"]) == (400, "invalid_request")


def test_grpc_callers_of_the_embedded_model_read_context_length_exceeded(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateChatCompletion(chat_request(model="chat-embedded", messages=LONG),
                                      metadata=bearer(gateway.secret))
    detail = error_details(caught.value).error
    assert (detail.code, detail.param) == ("context_length_exceeded", "messages")
    assert detail.message.startswith(f"This model's maximum context length is {WINDOW} tokens")


@pytest.mark.parametrize("call", ["create", "stream", "count_tokens"])
def test_a_prompt_over_the_embedded_models_window_is_anthropics_prompt_is_too_long(claude, call):
    with pytest.raises(anthropic.BadRequestError) as caught:
        if call == "count_tokens":
            claude.messages.count_tokens(model="messages-embedded", messages=LONG)
        else:
            claude.messages.create(model="messages-embedded", max_tokens=4, messages=LONG, stream=call == "stream")
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {WINDOW - 1} maximum", error["message"]), error
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("transport", ["grpc", "rest"])
def test_portico_clients_callers_read_the_specific_code_on_both_transports(gateway, double, transport):
    client = (PorticoClient.over_grpc(f"127.0.0.1:{gateway.port}", gateway.secret) if transport == "grpc"
              else PorticoClient.over_rest(gateway.base_url, gateway.secret))
    double.cue(Cue(status=400, body=upstream_error("content_policy_violation", param="messages")))
    with client:
        with pytest.raises(BadRequestError) as embedded:
            client.chat_completion("chat-embedded", LONG, max_tokens=1)
        with pytest.raises(BadRequestError) as upstream:
            client.chat_completion("chat-up", HI, max_tokens=1)
    assert (embedded.value.code, embedded.value.param) == ("context_length_exceeded", "messages")
    assert upstream.value.code == "content_policy_violation"
