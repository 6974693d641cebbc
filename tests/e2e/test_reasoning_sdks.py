"""Reasoning across dialects through the whole stack (real Envoy, `portico serve`), asked for and read by the official
SDKs: chat's `reasoning_effort` to a model behind Anthropic, Messages' `thinking` to one behind an OpenAI-compatible
server, and the upstream's thinking back in the caller's dialect (docs/api.md, Request bodies, Upstream providers)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import double_providers

HELLO = [{"role": "user", "content": "Weather in Oslo?"}]
LIMITED = "{tokens_per_minute: 10000}"


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    gpt, claude = double_providers(double.url)
    models = (f"  - {{id: chat-claude, endpoint: /v1/chat/completions, provider: {claude}}}\n"
              f"  - {{id: cached-chat-claude, endpoint: /v1/chat/completions, provider: {claude}, cache: {{}}}}\n"
              f"  - {{id: messages-gpt, endpoint: /v1/messages, provider: {gpt}}}\n"
              f"  - {{id: cached-messages-gpt, endpoint: /v1/messages, provider: {gpt}, cache: {{}}}}\n"
              f"  - {{id: limited-chat-gpt, endpoint: /v1/chat/completions, provider: {gpt}}}\n"
              f"  - {{id: limited-chat-claude, endpoint: /v1/chat/completions, provider: {claude}}}\n"
              # written after the models list: the tokens a request reserves, seen in what a limit admits
              f"limits: {{models: {{limited-chat-gpt: {LIMITED}, limited-chat-claude: {LIMITED}}}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("reasoning-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def test_a_chat_reasoning_effort_reaches_anthropic_as_a_thinking_budget(oai, double):
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high")
    sent = double.seen[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 4096}
    assert sent["max_tokens"] > 4096  # the default limit is the answer's: the budget comes on top
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="low",
                                max_completion_tokens=3000)
    assert double.seen[-1].body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert double.seen[-1].body["max_tokens"] == 3000
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="none")
    assert "thinking" not in double.seen[-1].body



def test_the_thinking_room_is_reserved_only_where_an_anthropic_upstream_is_sent_it(oai, double):
    """An OpenAI-compatible upstream gets the effort and the default limit (1024 here): the request reserves that,
    as before reasoning_effort was translated, not a thinking budget it is never sent (17408 tokens for `max`, over
    the model's 10000 a minute). Behind Anthropic the budget is sent on top of the default, and reserved."""
    raw = oai.chat.completions.with_raw_response.create(model="limited-chat-gpt", messages=HELLO,
                                                        reasoning_effort="max")
    assert double.seen[-1].body["max_tokens"] == 1024 and double.seen[-1].body["reasoning_effort"] == "max"
    assert 10000 - int(raw.headers["x-ratelimit-remaining-tokens"]) < 1100  # the prompt and 1024
    with pytest.raises(openai.RateLimitError, match="up to 17") as caught:
        oai.chat.completions.create(model="limited-chat-claude", messages=HELLO, reasoning_effort="max")
    # Its caller set no limit: the budget makes it large, and a limit must stay above the budget (a 400 below it).
    assert "Lower reasoning_effort" in caught.value.message and "max_tokens" not in caught.value.message

@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 4096}, "max_completion_tokens"),
    ({"temperature": 0.3}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"tools": [{"type": "function", "function": {"name": "weather"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_what_anthropic_refuses_beside_thinking_is_a_400_naming_the_chat_param(oai, double, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high", **fields)
    assert caught.value.param == param and not double.seen


def test_anthropics_400_about_a_limit_made_of_the_thinking_budget_names_the_effort(oai, double):
    """A caller who set no token limit is sent default_max_tokens plus the budget: a model whose output is capped
    below that refuses it. The caller never sent `max_tokens`, and only a lower effort helps, as a limit's 429 says."""
    refusal = "max_tokens: 17408 > 8192, which is the maximum allowed number of output tokens for claude-up"
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": refusal}}
    double.cue(Cue(status=400, body=error), Cue(status=400, body=error))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="max")
    assert double.seen[-1].body["max_tokens"] == 17408 and caught.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="max", max_tokens=20000)
    assert caught.value.param == "max_tokens"  # the caller's own limit


THOUGHT_MESSAGE = {
    "id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
    "content": [{"type": "thinking", "thinking": "Oslo in winter is cold.", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "b3BhcXVl"},
                {"type": "text", "text": "Cold."}],
    "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 20},
}


def thought_frames() -> list[bytes]:
    """THOUGHT_MESSAGE as Anthropic streams it: the thinking in two deltas and its signature, then the text."""
    events = [
        {"type": "message_start", "message": {**THOUGHT_MESSAGE, "content": [], "stop_reason": None,
                                              "usage": {"input_tokens": 5, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                      "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Oslo in winter"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": " is cold."}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2ln"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "redacted_thinking",
                                                                      "data": "b3BhcXVl"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "Cold."}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": 20}},
        {"type": "message_stop"},
    ]
    return [sse(event, event["type"]) for event in events]


def test_anthropic_thinking_reaches_a_chat_caller_as_reasoning_content(oai, double):
    double.cue(Cue(body=THOUGHT_MESSAGE), Cue(frames=thought_frames()))
    completion = oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high")
    message = completion.choices[0].message
    assert message.model_extra["reasoning_content"] == "Oslo in winter is cold."  # redacted thinking left out
    assert message.model_extra["thinking_blocks"] == [SIGNED, REDACTED]  # LiteLLM's member: the blocks whole
    assert message.content == "Cold." and completion.usage.completion_tokens == 20
    chunks = list(oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high",
                                              stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    reasoning = [d.model_extra["reasoning_content"] for d in deltas if (d.model_extra or {}).get("reasoning_content")]
    assert reasoning == ["Oslo in winter", " is cold."]
    contents = [d.content for d in deltas if d.content]
    assert contents == ["Cold."]
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(i < first_content for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content"))



CALL = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
SIGNED = {"type": "thinking", "thinking": "Oslo in winter is cold.", "signature": "c2ln"}
REDACTED = {"type": "redacted_thinking", "data": "b3BhcXVl"}


def calling_frames() -> list[bytes]:
    """thought_frames' thinking blocks, then a tool call instead of the text."""
    frames = thought_frames()[:8]
    events = [{"type": "content_block_start", "index": 2, "content_block": {**CALL, "input": {}}},
              {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                                    "partial_json": '{"city": "Oslo"}'}},
              {"type": "content_block_stop", "index": 2},
              {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
               "usage": {"output_tokens": 20}},
              {"type": "message_stop"}]
    return frames + [sse(event, event["type"]) for event in events]


def streamed_message(chunks) -> dict:
    """The assistant message a caller puts together from a stream: content, tool calls, and the thinking blocks of
    the raw chunks (LiteLLM's `delta.thinking_blocks`, which the openai SDK keeps in `model_extra`)."""
    message = {"role": "assistant", "content": None, "tool_calls": [], "thinking_blocks": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["thinking_blocks"] += (delta.model_extra or {}).get("thinking_blocks") or []
            for call in delta.tool_calls or []:
                if call.id:
                    message["tool_calls"].append({"id": call.id, "type": "function",
                                                  "function": {"name": call.function.name, "arguments": ""}})
                message["tool_calls"][call.index]["function"]["arguments"] += call.function.arguments or ""
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_tool_loop_gives_its_signed_thinking_back_and_keeps_thinking_on(oai, double, stream):
    """Step 1 thinks and calls a tool: its answer has the thinking blocks whole (LiteLLM's `thinking_blocks`, JSON
    and streamed). Step 2 sends the assistant message back with them: Anthropic gets the signed blocks first in that
    message, so thinking stays on for the loop's next step, as Anthropic documents."""
    double.cue(Cue(frames=calling_frames()) if stream else Cue(body={
        **THOUGHT_MESSAGE, "content": [*THOUGHT_MESSAGE["content"][:2], CALL], "stop_reason": "tool_use"}))
    first = oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high", tools=TOOLS,
                                        stream=stream)
    if stream:
        message = streamed_message(list(first))
        call_id = message["tool_calls"][0]["id"]
    else:
        assert first.choices[0].message.model_extra["thinking_blocks"] == [SIGNED, REDACTED]
        message = first.choices[0].message.model_dump(exclude_none=True)
        call_id = first.choices[0].message.tool_calls[0].id
    # Streamed, each block has its place in the list (the stream helper's `index`), ignored when given back.
    assert message["thinking_blocks"] == ([{"index": 0, **SIGNED}, {"index": 1, **REDACTED}] if stream
                                          else [SIGNED, REDACTED])
    assert double.seen[-1].body["thinking"]["type"] == "enabled"
    history = [*HELLO, message, {"role": "tool", "tool_call_id": call_id, "content": "-5C"}]
    second = oai.chat.completions.create(model="chat-claude", messages=history, reasoning_effort="high", tools=TOOLS)
    sent = double.seen[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 4096}
    assert sent["messages"][1]["content"][:2] == [SIGNED, REDACTED]
    assert sent["messages"][1]["content"][2]["type"] == "tool_use"
    assert second.choices[0].finish_reason == "stop"


def test_the_openai_sdks_stream_helper_puts_several_streamed_blocks_together_for_the_next_step(oai, double):
    """`chat.completions.stream()` sums the deltas, and takes a second item of a list member only with its `index`
    (as tool calls' have): before, the second block's chunk (here the redacted one) raised RuntimeError in the
    caller's code. Its summed message, given back, sends both blocks first, and thinking stays on."""
    double.cue(Cue(frames=calling_frames()))
    with oai.chat.completions.stream(model="chat-claude", messages=HELLO, reasoning_effort="high",
                                     tools=TOOLS) as stream:
        message = stream.get_final_completion().choices[0].message
    assert message.model_extra["thinking_blocks"] == [{"index": 0, **SIGNED}, {"index": 1, **REDACTED}]
    history = [*HELLO, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "-5C"}]
    oai.chat.completions.create(model="chat-claude", messages=history, reasoning_effort="high", tools=TOOLS)
    sent = double.seen[-1].body
    assert sent["thinking"]["type"] == "enabled" and sent["messages"][1]["content"][:2] == [SIGNED, REDACTED]


def test_a_tool_loop_without_its_thinking_blocks_goes_on_without_thinking(oai, double):
    """A history without the signed blocks (only `reasoning_content`, as a caller that drops unknown members keeps
    it): Anthropic would refuse thinking there, so that step is sent without it and its answer arrives."""
    double.cue(Cue(body={**THOUGHT_MESSAGE, "content": [THOUGHT_MESSAGE["content"][0], CALL],
                         "stop_reason": "tool_use"}))
    first = oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high", tools=TOOLS)
    message = first.choices[0].message.model_dump(exclude_none=True)
    del message["thinking_blocks"]
    history = [*HELLO, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "-5C"}]
    second = oai.chat.completions.create(model="chat-claude", messages=history, reasoning_effort="high", tools=TOOLS)
    assert "thinking" not in double.seen[-1].body
    assert second.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("block", "param"), [
    ({"type": "thinking", "thinking": "x"}, "messages[1].thinking_blocks[0].signature"),
    ({"type": "redacted_thinking", "data": 7}, "messages[1].thinking_blocks[0].data"),
    ({"type": "text", "text": "x"}, "messages[1].thinking_blocks[0].type"),
])
def test_a_malformed_thinking_block_is_a_400_naming_it_before_any_upstream(oai, double, block, param):
    history = [*HELLO, {"role": "assistant", "content": "Cold.", "thinking_blocks": [block]},
               {"role": "user", "content": "And Bergen?"}]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=history, reasoning_effort="high")
    assert caught.value.param == param and not double.seen


def test_thinking_blocks_anthropic_could_not_take_back_reach_an_openai_compatible_upstream_as_sent(oai, double):
    """LiteLLM's blocks from other providers may be unsigned: the whole body passes to a server of the caller's
    dialect, which judges them itself."""
    blocks = [{"type": "thinking", "thinking": "x", "signature": None}, {"type": "text", "text": "y"}]
    history = [*HELLO, {"role": "assistant", "content": "Cold.", "thinking_blocks": blocks},
               {"role": "user", "content": "And Bergen?"}]
    oai.chat.completions.create(model="limited-chat-gpt", messages=history)
    assert double.seen[-1].body["messages"][1]["thinking_blocks"] == blocks


@pytest.mark.parametrize("stream", [False, True])
def test_a_cached_chat_answer_replays_its_reasoning(oai, double, stream):
    double.cue(Cue(frames=thought_frames()) if stream else Cue(body=THOUGHT_MESSAGE))

    def asked():
        raw = oai.chat.completions.with_raw_response.create(
            model="cached-chat-claude", messages=HELLO, reasoning_effort="medium", stream=stream)
        answer = raw.parse()
        if stream:
            extras = [c.choices[0].delta.model_extra or {} for c in answer if c.choices]
            text = "".join(extra.get("reasoning_content") or "" for extra in extras)
            blocks = [block for extra in extras for block in extra.get("thinking_blocks") or []]
        else:
            text = answer.choices[0].message.model_extra["reasoning_content"]
            blocks = answer.choices[0].message.model_extra["thinking_blocks"]
        return raw.headers["x-portico-cache"], text, blocks

    blocks = [{"index": 0, **SIGNED}, {"index": 1, **REDACTED}] if stream else [SIGNED, REDACTED]
    assert asked() == ("miss", "Oslo in winter is cold.", blocks)
    assert asked() == ("hit", "Oslo in winter is cold.", blocks)
    assert len(double.seen) == 1


def test_a_messages_thinking_budget_reaches_an_openai_upstream_as_a_reasoning_effort(claude, double):
    claude.messages.create(model="messages-gpt", max_tokens=8000, messages=HELLO,
                           thinking={"type": "enabled", "budget_tokens": 2048})
    assert double.seen[-1].body["reasoning_effort"] == "medium"
    assert double.seen[-1].body["max_tokens"] == 8000
    claude.messages.create(model="messages-gpt", max_tokens=8000, messages=HELLO,
                           thinking={"type": "enabled", "budget_tokens": 6000})
    assert double.seen[-1].body["reasoning_effort"] == "high"
    claude.messages.create(model="messages-gpt", max_tokens=8000, messages=HELLO, thinking={"type": "disabled"})
    assert "reasoning_effort" not in double.seen[-1].body


def test_a_whole_float_thinking_budget_is_that_budget(claude, double):
    """A budget written as a whole float (`max_tokens * 0.25`: 2048.0), which the gateway and Anthropic's API take
    as the integer, asks for thinking: before, the budget was taken for none, so no effort was sent and the
    caller got no thinking block."""
    double.cue(Cue(body=REASONED_COMPLETION))
    message = claude.messages.create(model="messages-gpt", max_tokens=8192, messages=HELLO,
                                     thinking={"type": "enabled", "budget_tokens": 8192 * 0.25})
    assert double.seen[-1].body["reasoning_effort"] == "medium"
    assert [block.type for block in message.content] == ["thinking", "text"]


def chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> bytes:
    return sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                **({"usage": usage} if usage else {})})


REASONED_COMPLETION = {
    "id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Cold.", "reasoning_content": "Oslo in winter is cold."}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
}
# Streamed as vLLM sends it: `reasoning_content` (newer vLLM and OpenRouter: `reasoning`), then the answer.
REASONED_FRAMES = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Oslo in winter"}),
                   chunk({"reasoning": " is cold."}), chunk({"content": "Cold."}),
                   chunk({}, "stop", {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}),
                   b"data: [DONE]\n\n"]
THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_an_openai_upstreams_reasoning_reaches_a_messages_caller_as_a_thinking_block(claude, double):
    double.cue(Cue(body=REASONED_COMPLETION), Cue(frames=REASONED_FRAMES))
    message = claude.messages.create(model="messages-gpt", max_tokens=2000, messages=HELLO, thinking=THINKING)
    with claude.messages.stream(model="messages-gpt", max_tokens=2000, messages=HELLO, thinking=THINKING) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert [block.type for block in answer.content] == ["thinking", "text"]
        assert answer.content[0].thinking == "Oslo in winter is cold." and answer.content[0].signature == ""
        assert answer.content[1].text == "Cold." and answer.usage.output_tokens == 9


def test_a_tool_call_after_reasoning_is_the_block_after_the_thinking(claude, double):
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": None}), chunk({"reasoning_content": "Look it up."}),
                           chunk({"tool_calls": [call]}), chunk({}, "tool_calls"), b"data: [DONE]\n\n"]))
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    with claude.messages.stream(model="messages-gpt", max_tokens=2000, messages=HELLO, thinking=THINKING,
                                tools=tools) as stream:
        final = stream.get_final_message()
    assert [(block.type, getattr(block, "thinking", None)) for block in final.content] == [
        ("thinking", "Look it up."), ("tool_use", None)]
    assert final.stop_reason == "tool_use"


def test_a_messages_tool_loop_gives_an_openai_upstream_its_reasoning_back(claude, double):
    """DeepSeek's thinking mode refuses a tool loop's next step without the reasoning of the step before; Qwen3's
    and Kimi's templates read it there. Reasoning from before the caller's latest question is not sent back."""
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": None}), chunk({"reasoning_content": "Look it up."}),
                           chunk({"tool_calls": [call]}), chunk({}, "tool_calls"), b"data: [DONE]\n\n"]))
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    earlier = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet.", "signature": ""},
                                                 {"type": "text", "text": "Hello!"}]}]
    messages = [*earlier, *HELLO]
    with claude.messages.stream(model="messages-gpt", max_tokens=2000, messages=messages, thinking=THINKING,
                                tools=tools) as stream:
        step = stream.get_final_message()
    messages += [{"role": "assistant", "content": [block.model_dump() for block in step.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0", "content": "-3 C"}]}]
    claude.messages.create(model="messages-gpt", max_tokens=2000, messages=messages, thinking=THINKING, tools=tools)
    sent = double.seen[-1].body["messages"]
    assert [(m["role"], m.get("reasoning_content")) for m in sent] == [
        ("user", None), ("assistant", None), ("user", None), ("assistant", "Look it up."), ("tool", None)]
    assert sent[3]["tool_calls"][0]["id"] == "call_0"


def test_without_thinking_asked_for_a_messages_caller_gets_no_thinking_block(claude, double):
    """As Anthropic's API sends thinking blocks only when thinking is on (a reasoning server may reason anyway)."""
    double.cue(Cue(body=REASONED_COMPLETION), Cue(frames=REASONED_FRAMES))
    message = claude.messages.create(model="messages-gpt", max_tokens=2000, messages=HELLO)
    with claude.messages.stream(model="messages-gpt", max_tokens=2000, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    assert [block.type for block in message.content] == [block.type for block in streamed.content] == ["text"]


def test_a_cached_message_replays_its_thinking(claude, double):
    double.cue(Cue(body=REASONED_COMPLETION))
    for cache in ("miss", "hit"):
        raw = claude.messages.with_raw_response.create(model="cached-messages-gpt", max_tokens=2000, messages=HELLO,
                                                       thinking=THINKING)
        assert raw.headers["x-portico-cache"] == cache
        assert raw.parse().content[0].thinking == "Oslo in winter is cold."
    assert len(double.seen) == 1


def anthropic_stream(message: dict) -> list[bytes]:
    """`message` as Anthropic streams it: each block whole in one delta."""
    deltas = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}
    events = [{"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                    "usage": {"input_tokens": 5, "output_tokens": 1}}}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events.append({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
        else:
            kind, member = deltas[block["type"]]
            delta = {"type": kind, member: block[member]}
            events.append({"type": "content_block_start", "index": index, "content_block": {**block, member: ""}})
        events += [{"type": "content_block_delta", "index": index, "delta": delta},
                   {"type": "content_block_stop", "index": index}]
    events += [{"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": 20}}, {"type": "message_stop"}]
    return [sse(event, event["type"]) for event in events]


@pytest.mark.parametrize(("after", "stop_reason", "content"), [
    ([{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}], "tool_use", None),
    ([], "max_tokens", ""),  # cut short while thinking
])
def test_a_streamed_answer_that_thought_first_sums_to_the_content_of_the_json_one(oai, double, after, stop_reason,
                                                                                  content):
    """The openai SDK's stream helper sums the deltas: a call after the thinking has no content (null), as the JSON
    answer says, and thinking alone the JSON answer's "". Before, the role chunk's "" made a call's content ""."""
    message = {**THOUGHT_MESSAGE, "content": [THOUGHT_MESSAGE["content"][0], *after], "stop_reason": stop_reason}
    double.cue(Cue(body=message), Cue(frames=anthropic_stream(message)))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    whole = oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="low", tools=tools,
                                        max_completion_tokens=2000)
    state = ChatCompletionStreamState()  # what the stream helper sums (its get_final_completion() refuses `length`)
    for chunk_ in oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="low",
                                              tools=tools, max_completion_tokens=2000, stream=True):
        state.handle_chunk(chunk_)
    for answer in (whole, state.current_completion_snapshot):
        assert answer.choices[0].message.content == content
        assert answer.choices[0].message.model_extra["reasoning_content"] == "Oslo in winter is cold."


def test_a_streamed_call_after_redacted_thinking_alone_sums_to_no_content(oai, double):
    """An answer whose only thinking is redacted (no reasoning_content chunk) and then a call: the JSON answer's
    content is null, and the stream's role chunk said "" before, so the stream helper summed it to ""."""
    message = {**THOUGHT_MESSAGE, "content": [REDACTED, CALL], "stop_reason": "tool_use"}
    frames = anthropic_stream({**message, "content": [CALL]})
    redacted = [{"type": "content_block_start", "index": 0, "content_block": REDACTED},
                {"type": "content_block_stop", "index": 0}]
    # the call is the second block: its events' index 1
    frames = [frames[0], *(sse(event, event["type"]) for event in redacted),
              *(frame.replace(b'"index":0', b'"index":1') for frame in frames[1:])]
    double.cue(Cue(body=message), Cue(frames=frames))
    whole = oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="low", tools=TOOLS,
                                        max_completion_tokens=2000)
    with oai.chat.completions.stream(model="chat-claude", messages=HELLO, reasoning_effort="low", tools=TOOLS,
                                     max_completion_tokens=2000) as stream:
        streamed = stream.get_final_completion()
    for answer in (whole, streamed):
        assert answer.choices[0].message.content is None
        assert answer.choices[0].message.tool_calls[0].function.name == "weather"
    assert streamed.choices[0].message.model_extra["thinking_blocks"] == [{"index": 0, **REDACTED}]


def test_a_messages_count_on_an_openai_upstream_counts_the_thinking_it_is_sent(claude, double):
    """The estimate is of the prompt the server gets: thinking of an answer before the caller's latest question is
    left out of it (docs/api.md), so it is not counted either; before, 4,000 characters of it counted 1,000 tokens.
    The current tool loop's thinking goes back as reasoning_content, and counts."""
    thought = {"type": "thinking", "thinking": "x" * 4000, "signature": ""}
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]

    def counted(*thinking) -> int:
        earlier = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [*thinking, {"type": "text", "text": "Hello!"}]}]
        return claude.messages.count_tokens(model="messages-gpt", messages=[*earlier, *HELLO]).input_tokens

    assert counted(thought) == counted()
    loop = [*HELLO, {"role": "assistant", "content": [thought, CALL]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-5C"}]}]
    count = claude.messages.count_tokens(model="messages-gpt", messages=loop, tools=tools).input_tokens
    assert count > 1000
