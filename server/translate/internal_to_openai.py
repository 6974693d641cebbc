"""Internal completions and events -> OpenAI chat-completions JSON objects (dicts ready for server/wire_json.py).

An answer from an OpenAI-compatible upstream is the upstream's own objects (server/domain_answers.py
UpstreamObject), passed on with only what the gateway owns put in: Portico's `id` and `created`, and the model id the
caller asked for (the upstream's model name never reaches the caller). Everything else, `logprobs`,
`system_fingerprint`, `service_tier`, refusals, annotations and fields added later, arrives as the upstream sent it.
Other answers are rendered from the internal events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from server.domain import Dialect, Thought
from server.domain_answers import (
    Completion, FinishReason, Finished, GenerationEvent, ReasoningDelta, ResponseHeader, Started, TextDelta,
    ToolCallDelta, ToolCallStart, UpstreamObject, Usage,
)
from server.translate.thinking import thinking_block

FINISH_REASONS = {
    FinishReason.END_TURN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.MAX_TOKENS: "length",
    FinishReason.CONTEXT_WINDOW: "length",
    FinishReason.TOOL_USE: "tool_calls",
    FinishReason.REFUSAL: "content_filter",
}


def usage_object(usage: Usage) -> dict:
    out = {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_input_tokens:  # read from a prompt cache (Anthropic's cache_read_input_tokens), part of the prompt
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_input_tokens}
    return out


def _owned(header: ResponseHeader) -> dict:
    return {"id": header.id, "created": header.created, "model": header.model}


def chat_completion(header: ResponseHeader, completion: Completion) -> dict:
    upstream = completion.upstream
    if upstream is not None and upstream.dialect is Dialect.OPENAI:
        answer = {**upstream.payload, **_owned(header)}
        if not isinstance(answer.get("usage"), dict):  # a server that sent none: the counts the limits settled
            answer["usage"] = usage_object(completion.finish.usage)
        return answer
    message = {"role": "assistant", "content": completion.text, "refusal": None}
    if completion.reasoning:  # where DeepSeek and vLLM put it (the openai SDK keeps it: `message.model_extra`)
        message["reasoning_content"] = completion.reasoning
    if completion.thoughts:  # LiteLLM's member: the signed blocks, for the caller's next turn to give back
        message["thinking_blocks"] = [thinking_block(thought) for thought in completion.thoughts]
    if completion.tool_calls:
        message["content"] = completion.text or None  # as OpenAI answers a call without text
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in completion.tool_calls
        ]
    return {
        "id": header.id,
        "object": "chat.completion",
        "created": header.created,
        "model": header.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH_REASONS[completion.finish.reason],
            }
        ],
        "usage": usage_object(completion.finish.usage),
    }


async def chat_chunks(
    header: ResponseHeader, events: AsyncIterator[GenerationEvent], *, include_usage: bool
) -> AsyncIterator[dict]:
    """The chat.completion.chunk objects of a stream: role, content and tool-call deltas, finish, then usage if
    asked for."""
    first = await anext(events)
    if isinstance(first, UpstreamObject) and first.dialect is Dialect.OPENAI:
        # Relayed here, not by a generator of its own: one layer less that every open stream holds.
        relay = _Relay(header, include_usage=include_usage)
        if (out := relay.chunk(first)) is not None:
            yield out
        del first  # the role chunk: not held while the stream runs
        async for event in events:
            if (out := relay.chunk(event)) is not None:
                yield out
        return
    base = {"id": header.id, "object": "chat.completion.chunk", "created": header.created, "model": header.model}
    if include_usage:
        base["usage"] = None  # as OpenAI does: every chunk but the last carries usage: null

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}

    # The role chunk's content is null before reasoning too; an answer that then has neither text nor a call sums
    # to "" all the same, as the JSON answer's content without calls.
    nulled = answered = False
    blocks = 0  # thinking blocks sent: the next one's `index`

    def rendered(event: GenerationEvent) -> list[dict]:
        nonlocal answered, blocks
        if isinstance(event, TextDelta):
            answered = True
            return [chunk({"content": event.text})]
        if isinstance(event, ReasoningDelta):
            return [chunk({"reasoning_content": event.text})]
        if isinstance(event, ToolCallStart):
            answered = True
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [chunk({"tool_calls": [call]})]
        if isinstance(event, ToolCallDelta):
            return [chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})]
        if isinstance(event, Finished):
            finish = chunk({"content": ""} if nulled and not answered else {}, FINISH_REASONS[event.reason])
            return [finish, {**base, "choices": [], "usage": usage_object(event.usage)}] if include_usage else [finish]
        if isinstance(event, Thought):  # a whole block, once it ended: its text was streamed as reasoning_content
            # With its place in the answer's list, as tool calls' deltas have: the openai SDK's stream helper
            # refuses a second item of a list member without an `index`.
            blocks += 1
            return [chunk({"thinking_blocks": [{"index": blocks - 1, **thinking_block(event)}]})]
        return []

    # The role chunk waits for the first event it can speak of (not Started, nor the other dialect's objects), to
    # say as OpenAI does: content "" before text, null before a tool call (a stream of calls only then sums to
    # null, as the JSON answer has it) or reasoning (as DeepSeek does: the calls may follow it; redacted thinking,
    # a Thought without ReasoningDeltas, is reasoning too).
    while isinstance(first, (Started, UpstreamObject)):
        first = await anext(events)
    nulled = isinstance(first, (ToolCallStart, ReasoningDelta, Thought))
    yield chunk({"role": "assistant", "content": None if nulled else ""})
    for out in rendered(first):
        yield out
    async for event in events:
        for out in rendered(event):
            yield out


# What a chunk holds beside its choices when it carries nothing for the caller (Azure's chunk of
# `prompt_filter_results` does, and passes).
_USAGE_CHUNK_MEMBERS = frozenset(
    ("id", "object", "created", "model", "system_fingerprint", "service_tier", "obfuscation", "usage", "choices"))


class _Relay:
    """The upstream's own chunks (its role chunk included), with the header's id, created and model. Portico always
    asks an upstream for usage: a caller who did not gets neither the usage-only chunk nor `usage` members; one who
    did, from a server that sends no usage, gets a usage chunk made from the counts the limits settled."""

    __slots__ = ("_header", "_owned", "_include_usage", "_usage_sent")

    def __init__(self, header: ResponseHeader, *, include_usage: bool) -> None:
        self._header = header
        self._owned = _owned(header)
        self._include_usage = include_usage
        self._usage_sent = False

    def chunk(self, event: GenerationEvent) -> dict | None:
        """The chunk to send for `event`, if any."""
        if isinstance(event, UpstreamObject):
            chunk = {**event.payload, **self._owned}
            has_usage = isinstance(chunk.get("usage"), dict)
            if not self._include_usage:
                if not chunk.get("choices") and (has_usage or _USAGE_CHUNK_MEMBERS.issuperset(chunk)):
                    # The usage chunk Portico asked for, or what is left of it when a server put the usage on the
                    # finish chunk and still ended with empty `choices` (xAI's Grok): a caller who did not ask
                    # for usage never gets one from OpenAI, and `chunk.choices[0]` would fail on it.
                    return None
                chunk.pop("usage", None)
            self._usage_sent = self._usage_sent or has_usage
            return chunk
        if isinstance(event, Finished) and self._include_usage and not self._usage_sent:
            header = self._header
            return {"id": header.id, "object": "chat.completion.chunk", "created": header.created,
                    "model": header.model, "choices": [], "usage": usage_object(event.usage)}
        return None


def typed_reasoning(payload: dict) -> dict:
    """An answer or chunk for a typed caller: newer vLLM's and OpenRouter's `reasoning` (a string), which the typed
    messages do not declare, as their `reasoning_content` (a server's own `reasoning_content` stays as it is)."""
    choices = payload.get("choices")
    if not choices:
        return payload
    named = []
    for choice in choices:
        part = "message" if "message" in choice else "delta"
        said = choice.get(part)
        if isinstance(said, dict) and isinstance(said.get("reasoning"), str) and "reasoning_content" not in said:
            choice = {**choice, part: {**said, "reasoning_content": said["reasoning"]}}
        named.append(choice)
    return {**payload, "choices": named}
