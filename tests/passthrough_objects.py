"""What upstreams answer with fields Portico's internal values do not carry (logprobs, system_fingerprint,
service_tier, thinking and redacted thinking with signatures, citations): the literal objects the passthrough tests
send through the renderers (tests/unit) and through the upstream double (tests/service)."""

from __future__ import annotations

from tests.upstream_double import Cue
from tests.upstream_echo import sse

UPSTREAM_MODEL = "upstream-secret-model-name"  # what the upstream calls itself: must never reach a caller
LOGPROBS = {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
    {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}, {"token": "Hello", "logprob": -1.5, "bytes": None}]}],
    "refusal": None}
CALL = {"id": "call_abc", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}
COMPLETION = {
    "id": "chatcmpl-upstream", "object": "chat.completion", "created": 1, "model": UPSTREAM_MODEL,
    "system_fingerprint": "fp_0123", "service_tier": "default",
    "choices": [{"index": 0, "logprobs": LOGPROBS, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Hi", "refusal": None, "annotations": [], "tool_calls": [CALL]}}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
              "completion_tokens_details": {"reasoning_tokens": 0}},
}
THINKING = {"type": "thinking", "thinking": "The user wants the weather.", "signature": "EqQBCkYIARgCKkA="}
MESSAGE = {
    "id": "msg_upstream", "type": "message", "role": "assistant", "model": UPSTREAM_MODEL,
    "content": [THINKING, {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
                {"type": "text", "text": "Checking.", "citations": None},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}],
    "stop_reason": "tool_use", "stop_sequence": None, "container": None,
    "usage": {"input_tokens": 20, "output_tokens": 12, "cache_creation_input_tokens": 0,
              "cache_read_input_tokens": 0, "service_tier": "standard"},
}


def chunk(delta: dict | None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": "chatcmpl-upstream", "object": "chat.completion.chunk", "created": 1, "model": UPSTREAM_MODEL,
            "system_fingerprint": "fp_0123", "service_tier": "default", "choices": choices, **extra}


CHUNKS = [
    chunk({"role": "assistant", "content": "", "refusal": None}, usage=None),
    {**chunk({"content": "Hi"}, usage=None), "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": LOGPROBS, "finish_reason": None}]},
    chunk({"tool_calls": [{"index": 0, **CALL, "function": {"name": "weather", "arguments": ""}}]}, usage=None),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Oslo\"}"}}]}, usage=None),
    chunk({}, "tool_calls", usage=None),
    chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}),
]


# An Anthropic upstream's answer, read mostly from its prompt cache (2,000 tokens read, 100 written, 10 not cached):
# as a JSON answer, then as a stream.
_CACHED_USAGE = {"input_tokens": 10, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000,
                 "output_tokens": 1}
_CACHED_MESSAGE = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
                   "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "usage": _CACHED_USAGE}
_CACHED_EVENTS = [{"type": "message_start", "message": {**_CACHED_MESSAGE, "content": [], "stop_reason": None}},
                  {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
                  {"type": "content_block_stop", "index": 0},
                  {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                   "usage": {"output_tokens": 1}},
                  {"type": "message_stop"}]
CACHED_ANSWER_CUES = (Cue(body=_CACHED_MESSAGE), Cue(frames=[sse(e, e["type"]) for e in _CACHED_EVENTS]))
