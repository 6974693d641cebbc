"""What a caller gets from an upstream of the other dialect, beyond text: parallel tool calls whose argument pieces
interleave, refusals, prompt-cache counts, and a tool's error sent back."""

from __future__ import annotations

import re

from server.domain_answers import (
    Completion, FinishReason, Finished, ResponseHeader, TextDelta, ToolCallStart, Usage, random_call_ids,
)
from server.translate import internal_to_anthropic as to_anthropic
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import message_events
from server.translate.anthropic_to_internal import message_request
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_chunks_to_internal import OpenAIChunkReader, completion_events
from tests.helpers import message_body as message_pb

MESSAGE = ResponseHeader(id="msg_9", created=1700000000, model="family-b-opus-4-8")
CHAT = ResponseHeader(id="chatcmpl-9", created=1700000000, model="family-a-5.5")


def calls_chunk(*calls: dict) -> dict:
    return {"choices": [{"index": 0, "delta": {"tool_calls": list(calls)}}]}


def call_start(index: int, call_id: str, name: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def piece(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
# Both calls start, then their argument pieces alternate: legal OpenAI chunking.
INTERLEAVED = [
    calls_chunk(call_start(0, "call_a", "weather"), call_start(1, "call_b", "clock")),
    calls_chunk(piece(0, '{"city":')), calls_chunk(piece(1, '{"zone":')),
    calls_chunk(piece(0, '"Oslo"}')), calls_chunk(piece(1, '"CET"}')),
    FINISH,
]
# One call after the other.
SEQUENTIAL = [
    {"choices": [{"index": 0, "delta": {"content": "On it."}}]},
    calls_chunk(call_start(0, "call_a", "weather")),
    calls_chunk(piece(0, '{"city":')), calls_chunk(piece(0, '"Oslo"}')),
    calls_chunk(call_start(1, "call_b", "clock")), calls_chunk(piece(1, '{"zone":"CET"}')),
    FINISH,
]


def brief(event: dict) -> tuple:
    """An Anthropic stream event, short: its type, block index and what it carries."""
    kind, index = event["type"], event.get("index")
    if kind == "content_block_start":
        return "start", index, event["content_block"].get("id", event["content_block"]["type"])
    if kind == "content_block_delta":
        delta = event["delta"]
        return "delta", index, delta.get("partial_json", delta.get("text"))
    if kind == "content_block_stop":
        return "stop", index
    if kind == "message_delta":
        return "message_delta", event["delta"]["stop_reason"], event["usage"]
    return (kind,)


async def reframed(chunks: list[dict]) -> list:
    """The chunks read and re-framed as Anthropic events, with each chunk ("in", n) logged before what it made."""
    reader = OpenAIChunkReader(prompt_estimate=1)
    log: list = []

    async def events():
        for number, chunk in enumerate(chunks):
            log.append(("in", number))
            for event in reader.feed(chunk):
                yield event
        yield reader.end()

    async for event in to_anthropic.message_events(MESSAGE, events()):
        log.append(brief(event))
    return log


def well_formed(log: list) -> bool:
    """One block open at a time, blocks numbered in order, and no delta for a block that is not the open one."""
    open_block, started = None, 0
    for entry in log:
        if entry[0] == "start":
            if open_block is not None or entry[1] != started:
                return False
            open_block, started = entry[1], started + 1
        elif entry[0] in ("delta", "stop") and entry[1] != open_block:
            return False
        elif entry[0] == "stop":
            open_block = None
    return open_block is None


async def test_interleaved_tool_calls_leave_one_block_after_the_other():
    log = await reframed(INTERLEAVED)
    assert [entry for entry in log if entry[0] != "in"][1:-2] == [
        ("start", 0, "call_a"), ("ping",), ("delta", 0, '{"city":'), ("delta", 0, '"Oslo"}'), ("stop", 0),
        ("start", 1, "call_b"), ("delta", 1, '{"zone":'), ("delta", 1, '"CET"}'), ("stop", 1),
    ]
    assert well_formed(log)
    # The second call leaves as soon as the first one's arguments are whole, not at the end.
    assert log.index(("start", 1, "call_b")) < log.index(("in", 4))
    # Calls one after the other are streamed as they arrive, as before: nothing is held.
    log = await reframed(SEQUENTIAL)
    assert well_formed(log)
    assert log[log.index(("in", 4)):][:3] == [("in", 4), ("stop", 1), ("start", 2, "call_b")]
    assert log[log.index(("in", 5)):][:2] == [("in", 5), ("delta", 2, '{"zone":"CET"}')]


async def test_a_call_held_behind_one_that_never_completes_leaves_whole_at_the_end():
    broken = [*INTERLEAVED[:3], calls_chunk(piece(0, '"Oslo"')), calls_chunk(piece(1, '"CET"}')), FINISH]
    log = await reframed(broken)
    assert well_formed(log)
    assert log[log.index(("in", 5)):][:5] == [
        ("in", 5), ("stop", 0), ("start", 1, "call_b"), ("delta", 1, '{"zone":"CET"}'), ("stop", 1)]


async def test_text_that_arrives_in_the_middle_of_a_call_follows_it():
    text = {"choices": [{"index": 0, "delta": {"content": "Also"}}]}
    chunks = [calls_chunk(call_start(0, "call_a", "weather"), piece(0, '{"city":')), text, text,
              calls_chunk(piece(0, '"Oslo"}')), FINISH]
    log = await reframed(chunks)
    assert well_formed(log)
    assert [entry for entry in log if entry[0] != "in"][1:-2] == [
        ("start", 0, "call_a"), ("ping",), ("delta", 0, '{"city":'), ("delta", 0, '"Oslo"}'), ("stop", 0),
        ("start", 1, "text"), ("delta", 1, "AlsoAlso"), ("stop", 1)]


REFUSED = {"choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": None, "refusal": "I can't help with that."}}],
           "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}


def test_an_openai_refusal_is_text_and_stop_reason_refusal_for_an_anthropic_caller():
    events = completion_events(REFUSED, prompt_estimate=1)
    assert events == [TextDelta("I can't help with that."),
                      Finished(FinishReason.REFUSAL, Usage(9, 6), upstream_reason="stop")]
    text, finished = events
    message = to_anthropic.message(MESSAGE, Completion(text.text, finished))
    assert (message["content"], message["stop_reason"]) == (
        [{"type": "text", "text": "I can't help with that."}], "refusal")
    # And back: Anthropic's `refusal` is OpenAI's content_filter, with what the model said.
    refused = {"type": "message", "content": [{"type": "text", "text": "I won't."}], "stop_reason": "refusal",
               "usage": {"input_tokens": 5, "output_tokens": 3}}
    choice = to_openai.chat_completion(CHAT, Completion("I won't.", message_events(refused)[-1]))["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("content_filter", "I won't.")


def test_a_tool_use_block_s_null_members_are_not_the_text_none():
    """A compatible server's tool_use block with `id` and `name` null: the call's id was "None", its name "None"."""
    blocks = [{"type": "tool_use", "id": None, "name": None, "input": {}}]
    start = message_events({"type": "message", "content": blocks, "stop_reason": "tool_use"})[1]
    assert (start.id, start.name) == ("toolu_0", "")


def test_ids_for_calls_sent_without_one_come_from_the_reader_s_caller():
    """Numbered per answer, the made-up ids repeated from turn to turn (`call_0` each time): the readers take them
    from their caller (a provider's are random), and keep every id the upstream gave."""
    made = lambda index: f"made_{index}"  # noqa: E731
    calls = [{"type": "function", "function": {"name": "a", "arguments": "{}"}},
             {"id": "call_up", "type": "function", "function": {"name": "b", "arguments": "{}"}}]
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"tool_calls": calls}}]}
    events = completion_events(completion, prompt_estimate=1, call_ids=made)
    assert [e.id for e in events if isinstance(e, ToolCallStart)] == ["made_0", "call_up"]
    blocks = [{"type": "tool_use", "id": "toolu_up", "name": "a", "input": {}}, {"type": "tool_use", "name": "b"}]
    message = {"type": "message", "content": blocks, "stop_reason": "tool_use"}
    assert [e.id for e in message_events(message, call_ids=made) if isinstance(e, ToolCallStart)] == [
        "toolu_up", "made_1"]
    fresh = random_call_ids("call_")
    ids = {fresh(0) for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_an_answer_the_context_window_ended_is_length_for_a_chat_caller():
    cut = {"type": "message", "content": [{"type": "text", "text": "and so"}], "usage": {"input_tokens": 9,
           "output_tokens": 2}, "stop_reason": "model_context_window_exceeded"}
    finished = message_events(cut)[-1]
    assert finished.reason is FinishReason.CONTEXT_WINDOW
    assert to_openai.chat_completion(CHAT, Completion("and so", finished))["choices"][0]["finish_reason"] == "length"
    message = to_anthropic.message(MESSAGE, Completion("and so", Finished(FinishReason.CONTEXT_WINDOW, Usage(9, 2))))
    assert message["stop_reason"] == "model_context_window_exceeded"


async def test_a_streamed_openai_refusal_is_text_deltas_and_stop_reason_refusal():
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None, "refusal": ""}}]},
              {"choices": [{"index": 0, "delta": {"refusal": "I can't "}}]},
              {"choices": [{"index": 0, "delta": {"refusal": "help with that."}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    log = [entry for entry in await reframed(chunks) if entry[0] != "in"]
    assert log[1:-1] == [("start", 0, "text"), ("ping",), ("delta", 0, "I can't "), ("delta", 0, "help with that."),
                         ("stop", 0), ("message_delta", "refusal", {"input_tokens": 1, "output_tokens": 2})]


ANTHROPIC_CACHED = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                    "usage": {"input_tokens": 10, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000,
                              "output_tokens": 7}}
OPENAI_CACHED = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 1200, "completion_tokens": 5, "total_tokens": 1205,
                           "prompt_tokens_details": {"cached_tokens": 1024}}}


async def _replay(events):
    for event in events:
        yield event


async def test_anthropic_cache_reads_reach_an_openai_caller_as_cached_tokens():
    finished = message_events(ANTHROPIC_CACHED)[-1]
    usage = {"prompt_tokens": 2110, "completion_tokens": 7, "total_tokens": 2117,
             "prompt_tokens_details": {"cached_tokens": 2000}}  # cache writes are prompt tokens, not cached ones
    assert to_openai.chat_completion(CHAT, Completion("hi", finished))["usage"] == usage
    chunks = [c async for c in to_openai.chat_chunks(CHAT, _replay([finished]), include_usage=True)]
    assert chunks[-1]["usage"] == usage


async def test_openai_cached_tokens_reach_an_anthropic_caller_as_cache_reads():
    events = completion_events(OPENAI_CACHED, prompt_estimate=1)
    usage = {"input_tokens": 176, "cache_read_input_tokens": 1024, "output_tokens": 5}  # 176 + 1024 = the prompt
    assert to_anthropic.message(MESSAGE, Completion("hi", events[-1]))["usage"] == usage
    streamed = [e async for e in to_anthropic.message_events(MESSAGE, _replay(events))]
    assert streamed[-2]["usage"] == usage
    no_cache = Completion("hi", Finished(FinishReason.END_TURN, Usage(4, 2)))
    assert to_anthropic.message(MESSAGE, no_cache)["usage"] == {"input_tokens": 4, "output_tokens": 2}
    assert "prompt_tokens_details" not in to_openai.chat_completion(CHAT, no_cache)["usage"]


def test_a_tool_error_reaches_an_openai_upstream_marked():
    request = message_pb(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {}},
                                          {"type": "tool_use", "id": "t2", "name": "weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "city not found"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "4 C"}]}]}])
    body = openai_body(message_request(request).generation, model="gpt-up")
    assert [m for m in body["messages"] if m["role"] == "tool"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "Error: city not found"},
        {"role": "tool", "tool_call_id": "t2", "content": "4 C"}]

