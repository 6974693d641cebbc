"""Anthropic translators: request validation and the literal SSE transcript of a streamed message."""

from __future__ import annotations

import pytest

from server.domain import Dialect, Role, ToolCall, ToolChoice, ToolChoiceMode, Thought, ToolResult, ToolSpec, Turn
from server.domain_answers import Completion, FinishReason, Finished, ResponseHeader, Started, TextDelta, Usage
from server.errors import InvalidRequest
from server.render import sse_event
from server.translate import internal_to_anthropic as to_anthropic
from server.translate.anthropic_to_internal import count_request, message_request
from server.translate.internal_to_anthropic_request import count_body
from tests.helpers import message_body as request_pb

HEADER = ResponseHeader(id="msg_1", created=1700000000, model="family-b-opus-4-8")


def test_system_blocks_and_tool_traffic_become_turns():
    plan = message_request(request_pb(system="Be brief.", top_k=5, stop_sequences=["##"], messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calc", "input": {"x": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4"}]},
    ]))
    assert plan.generation.turns == (
        Turn(Role.SYSTEM, "Be brief."),
        Turn(Role.USER, "2+2?"),
        Turn(Role.ASSISTANT, tool_calls=(ToolCall("t1", "calc", '{"x":2}'),)),
        Turn(Role.USER, tool_results=(ToolResult("t1", "4"),)),
    )
    assert (plan.generation.params.top_k, plan.generation.params.stop) == (5, ("##",))
    assert plan.generation.params.temperature is None and plan.generation.source.dialect is Dialect.ANTHROPIC


def test_tools_and_tool_choice():
    generation = message_request(request_pb(
        tools=[{"name": "calc", "description": "Adds.", "input_schema": {"type": "object", "required": ["x"]}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )).generation
    assert generation.tools == (ToolSpec("calc", "Adds.", {"type": "object", "required": ["x"]}),)
    assert generation.tool_choice == ToolChoice(ToolChoiceMode.REQUIRED, parallel=False)
    thinking = message_request(request_pb(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]}]},
    ])).generation
    assert thinking.turns[1] == Turn(Role.ASSISTANT, "Hello", thoughts=(Thought("hm", "s"),))
    assert thinking.turns[2].tool_results == (ToolResult("t", "boom", is_error=True),)



def test_a_last_assistant_text_turn_is_a_prefill_the_answer_continues():
    ask = {"role": "user", "content": "Hi"}
    prefilled = message_request(request_pb(messages=[ask, {"role": "assistant", "content": "Hello,"}])).generation
    assert prefilled.turns[-1] == Turn(Role.ASSISTANT, "Hello,", continued=True)
    # Not a prefill: an earlier assistant turn, or a last one that only calls a tool (its result must come first).
    earlier = message_request(request_pb(messages=[ask, {"role": "assistant", "content": "Hello,"}, ask]))
    assert not any(turn.continued for turn in earlier.generation.turns)
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calc", "input": {}}]}
    assert not message_request(request_pb(messages=[ask, call])).generation.turns[-1].continued


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"top_k": -1}, "top_k"), ({"stop_sequences": ["a", ""]}, "stop_sequences[1]"),
     ({"messages": [{"role": "user"}]}, "messages[0].content"),
     ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
     ({"tool_choice": {"type": 7}}, "tool_choice.type"),  # a kind it does not know passes to Anthropic alone
     ({"temperature": "hot"}, "temperature"), ({"metadata": {"user_id": 5}}, "metadata.user_id"),
     ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text")],
)
def test_rejections_name_the_param(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        message_request(request_pb(**fields))
    assert caught.value.param == param


def test_message_object():
    completion = Completion("Hi", Finished(FinishReason.END_TURN, Usage(4, 2)))
    assert to_anthropic.message(HEADER, completion) == {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "Hi"}],
        "model": "family-b-opus-4-8", "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 2},
    }


async def test_sse_transcript():
    async def events():
        for event in (Started(4), TextDelta("Hi"), Finished(FinishReason.STOP_SEQUENCE, Usage(4, 2), "##")):
            yield event

    frames = [sse_event(e, e["type"]) async for e in to_anthropic.message_events(HEADER, events())]
    assert b"".join(frames).decode() == (
        'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
        '"role":"assistant","content":[],"model":"family-b-opus-4-8","stop_reason":null,"stop_sequence":null,'
        '"usage":{"input_tokens":4,"output_tokens":0}}}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}\n\n'
        'event: ping\ndata: {"type":"ping"}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"Hi"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"stop_sequence",'
        '"stop_sequence":"##"},"usage":{"input_tokens":4,"output_tokens":2}}\n\n'
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


def test_a_count_needs_no_max_tokens_but_a_message_does():
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert count_request(body).turns == (Turn(Role.USER, "Hi"),)
    with pytest.raises(InvalidRequest) as caught:
        message_request(body)
    assert caught.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as caught:  # checked as on /v1/messages, though it shapes no count
        count_request({**body, "max_tokens": 0})
    assert caught.value.param == "max_tokens"


def test_an_upstream_counts_the_body_without_what_only_shapes_a_generation():
    body = {"model": "ours", "messages": [{"role": "user", "content": "Hi"}], "system": "Be brief.",
            "tools": [{"name": "t", "input_schema": {"type": "object"}}], "thinking": {"type": "disabled"},
            "vendor_field": {"kept": True}, "max_tokens": 5, "stream": True, "temperature": 0.2, "top_p": 0.9,
            "top_k": 3, "stop_sequences": ["##"], "metadata": {"user_id": "u"}, "service_tier": "auto"}
    sent = count_body(count_request(body, beta=("b1",)), model="upstream-name")
    assert sent == {"model": "upstream-name", "messages": body["messages"], "system": "Be brief.",
                    "tools": body["tools"], "thinking": {"type": "disabled"}, "vendor_field": {"kept": True}}
    assert body["model"] == "ours" and body["max_tokens"] == 5  # the caller's body is never edited


@pytest.mark.parametrize(("thinking", "param"), [
    ({"type": "enabled", "budget_tokens": 32}, "thinking.budget_tokens"),  # under Anthropic's least, 1024
    ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # not under max_tokens
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "later"}, "thinking.type"),
    ({}, "thinking.type"),
    ({"type": "enabled", "budget_tokens": 1024, "display": "full"}, "thinking.display"),
    ({"type": "adaptive", "display": "hidden"}, "thinking.display"),
])
def test_a_thinking_anthropics_api_refuses_is_refused_by_other_models_not_an_anthropic_upstream(thinking, param):
    """Refused by the embedded model and an OpenAI-compatible upstream, as Anthropic's API would refuse it; an
    Anthropic upstream is sent it whole and judges it (a type added to the API later may be one it takes)."""
    [refusal] = message_request(request_pb(max_tokens=4096, thinking=thinking)).generation.source.unread
    assert (refusal.param, refusal.embedded, refusal.other_dialect) == (param, True, True)
    count = {k: v for k, v in request_pb(thinking=thinking).items() if k != "max_tokens"}  # none to compare with
    counted = count_request(count).source.unread
    assert [u.param for u in counted] == ([] if thinking.get("budget_tokens") == 4096 else [param])


def test_a_thinking_anthropics_api_takes_is_no_refusal():
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"},
                     {"type": "adaptive", "display": "omitted"}, {"type": "enabled", "budget_tokens": 1024,
                                                                   "display": "summarized"}):
        assert not message_request(request_pb(max_tokens=1025, thinking=thinking)).generation.source.unread
