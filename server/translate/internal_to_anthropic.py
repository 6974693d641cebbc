"""Internal completions and events -> Anthropic Messages JSON objects (dicts ready for server/wire_json.py).

An answer from an Anthropic upstream is the upstream's own message or events (server/domain_answers.py UpstreamObject),
passed on with only what the gateway owns put in: Portico's `id` and the model id the caller asked for (the
upstream's model name never reaches the caller). Thinking and redacted-thinking blocks with their signatures,
citations, `container`, server tools' blocks, pings and fields added later arrive as the upstream sent them. Other
answers are rendered from the internal events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from server import wire_json
from server.domain import Dialect, Json, ToolCall
from server.domain_answers import (
    Completion, FinishReason, Finished, GenerationEvent, ReasoningDelta, ResponseHeader, Started, TextDelta, TokenCount,
    ToolCallDelta, ToolCallStart, UpstreamObject, Usage,
)
from server.errors import UpstreamError
from server.translate.json_prefix import WHITESPACE, JsonObjectPrefix

STOP_REASONS = {
    FinishReason.END_TURN: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.MAX_TOKENS: "max_tokens",
    FinishReason.CONTEXT_WINDOW: "model_context_window_exceeded",
    FinishReason.TOOL_USE: "tool_use",
    FinishReason.REFUSAL: "refusal",
}


def usage_object(usage: Usage) -> dict:
    """Anthropic's split of the prompt: `input_tokens` are the ones not read from a prompt cache."""
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    if not cached:
        return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    return {"input_tokens": usage.input_tokens - cached, "cache_read_input_tokens": cached,
            "output_tokens": usage.output_tokens}


def tool_input(call: ToolCall) -> dict:
    """A call's arguments as the `input` object. Models behind OpenAI-compatible servers sometimes write invalid
    JSON; it is kept (under "arguments") rather than dropped, so the caller can see what the model wrote. Whitespace
    alone is no arguments, {}, as a stream of the same call gives it (its whitespace before the object is left out)."""
    try:
        value = wire_json.loads(call.arguments.strip() or "{}")
    except wire_json.JSONDecodeError:
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def token_count(count: TokenCount) -> dict:
    """count_tokens' answer: an upstream's own (already with our model id for its), else `{"input_tokens": N}`."""
    return dict(count.upstream) if count.upstream is not None else {"input_tokens": count.input_tokens}


def message(header: ResponseHeader, completion: Completion, *, thinking: bool = False) -> dict:
    """`thinking`: the caller asked for thinking (enabled or adaptive), so the model's reasoning is a thinking block
    first, as Anthropic's API sends it only then; its signature is empty (no upstream of this dialect made one)."""
    upstream = completion.upstream
    if upstream is not None and upstream.dialect is Dialect.ANTHROPIC:
        answer = {**upstream.payload, "id": _id(header, upstream.payload), "model": header.model}
        if not isinstance(answer.get("usage"), Mapping):  # a server that sent none: the counts the limits settled
            answer["usage"] = usage_object(completion.finish.usage)
        return answer
    finish = completion.finish
    content: list[dict] = []
    if thinking and completion.reasoning:
        content.append({"type": "thinking", "thinking": completion.reasoning, "signature": ""})
    # Anthropic answers no empty text block beside calls or thinking (a thinking block alone: cut while thinking).
    if completion.text or not (completion.tool_calls or content):
        content.append({"type": "text", "text": completion.text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c)} for c in completion.tool_calls]
    return {
        "id": header.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": header.model,
        "stop_reason": STOP_REASONS[finish.reason],
        "stop_sequence": finish.stop_sequence,
        "usage": usage_object(finish.usage),
    }


async def message_events(header: ResponseHeader, events: AsyncIterator[GenerationEvent], *,
                         thinking: bool = False) -> AsyncIterator[dict]:
    """The event objects of a streamed message, in the order the Anthropic SDK expects; each has its `type`,
    which is also the SSE event name. `thinking`: as for `message`, the reasoning streamed as a thinking block."""
    first = await anext(events)
    if isinstance(first, UpstreamObject) and first.dialect is Dialect.ANTHROPIC:
        relayed = _relayed_events(header, first, events)
        del first  # the upstream's message_start: not held here while the stream runs
        async for event in relayed:
            yield event
        return
    while isinstance(first, UpstreamObject):  # another dialect's: rendered from the internal events instead
        first = await anext(events)
    input_tokens = first.input_tokens if isinstance(first, Started) else 0
    yield {
        "type": "message_start",
        "message": {
            "id": header.id, "type": "message", "role": "assistant", "content": [], "model": header.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    }
    blocks = _Blocks(thinking=thinking)
    if not isinstance(first, Started):
        for out in blocks.feed(first):
            yield out
    async for event in events:
        for out in blocks.feed(event):
            yield out


async def _relayed_events(
    header: ResponseHeader, first: UpstreamObject, events: AsyncIterator[GenerationEvent]
) -> AsyncIterator[dict]:
    """Every event the upstream sent, in its order; message_start with the header's id and model. The SDK reads
    message_start's and message_delta's usage, which Anthropic always sends: from a server that sends none, they get
    the counts the limits settle (message_start's once the prompt's count follows it; message_delta's, and what comes
    after it, wait for the answer's end, which the next events bring)."""
    start: dict | None = _owned_event(header, first.payload)
    del first  # neither it nor the start made of it is held once sent
    started = start.get("message") if start.get("type") == "message_start" else None
    if not isinstance(started, dict) or isinstance(started.get("usage"), Mapping):
        yield start
        start = started = None
    held: list[dict] = []  # a message_delta without usage, and the events after it
    async for event in events:
        if isinstance(event, Started) and start is not None:
            started["usage"] = {"input_tokens": event.input_tokens, "output_tokens": 0}
            yield start
            start = started = None
        elif isinstance(event, UpstreamObject):
            out = _owned_event(header, event.payload)
            if held or out.get("type") == "message_delta" and not isinstance(out.get("usage"), Mapping):
                held.append(out)
            else:
                yield out
        elif isinstance(event, Finished) and held:
            held[0]["usage"] = usage_object(event.usage)
            for out in held:
                yield out
            held.clear()


def _owned_event(header: ResponseHeader, event: Mapping[str, Json]) -> dict:
    if event.get("type") == "message_start" and isinstance(started := event.get("message"), Mapping):
        return {**event, "message": {**started, "id": _id(header, started), "model": header.model}}
    return dict(event)


def _id(header: ResponseHeader, upstream: Mapping[str, Json]) -> str:
    kept = upstream.get("id") if header.upstream_id else None
    return kept if isinstance(kept, str) and kept else header.id


_TEXT = -1  # the stream key of text; a tool call's is its index (0, 1, ...)
_THINKING = -2  # the stream key of reasoning
_TEXT_BLOCK = {"type": "text", "text": ""}
# The SDK's accumulator needs no signature_delta: the block's start gives its `signature`, empty.
_THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}


@dataclass(slots=True)
class _Block:
    key: int  # _TEXT, _THINKING or the tool call's index
    start: dict  # its content_block_start's block
    pieces: list[str]  # held: the pieces not sent yet; an open call: its arguments so far
    index: int = -1  # its block index, once started


class _Blocks:
    """Content blocks, opened as their first event arrives (text, or one block per tool call). The Messages
    protocol has one block open at a time and takes no deltas for a block after its content_block_stop, while an
    OpenAI-compatible upstream may interleave the argument pieces of parallel tool calls. So a block is closed
    only when it is done: text at any time (more text opens another block), a tool call once its arguments are a
    whole JSON value. What arrives for another block while an unfinished call is open is held, and leaves (start,
    pieces so far) as soon as that call is whole, or when the answer ends. Streams that do not interleave are
    never held."""

    def __init__(self, *, thinking: bool = False) -> None:
        self._thinking = thinking  # reasoning is shown (a thinking block), else left out
        self._next = 0  # index of the next block
        self._open: _Block | None = None
        self._held: dict[int, _Block] = {}  # by stream key, in order of arrival
        self._calls: dict[int, tuple[str, JsonObjectPrefix]] = {}  # by call index: its name, its arguments so far
        # Reasoning that arrived while a text block was open: it waits for the text to end (a tool call, the answer's
        # end), so the text stays one block, as in the JSON answer (the SDK parses each text block of a structured
        # output alone, and fails on half of the JSON).
        self._late: _Block | None = None

    def feed(self, event: GenerationEvent) -> list[dict]:
        if isinstance(event, TextDelta):
            return self._arrived(_TEXT, _TEXT_BLOCK, event.text)
        if isinstance(event, ReasoningDelta):
            if not self._thinking:
                return []
            if self._late is None and (self._open is None or self._open.key != _TEXT):
                return self._arrived(_THINKING, _THINKING_BLOCK, event.text)
            self._late = self._late or _Block(_THINKING, _THINKING_BLOCK, [])
            self._late.pieces.append(event.text)
            return []
        if isinstance(event, ToolCallStart):
            self._calls[event.index] = (event.name, JsonObjectPrefix())
            return [*self._after_text(), *self._arrived(event.index, {"type": "tool_use", "id": event.id,
                                                                      "name": event.name, "input": {}})]
        if isinstance(event, ToolCallDelta):  # only for a call open or held: never while text is open
            return self._arrived(event.index, None, self._checked(event.index, event.arguments))
        if isinstance(event, Finished):
            out = [*self._after_text(), *self._close()]
            for block in self._held.values():
                out += [*self._started(block), *self._close()]
            self._held.clear()
            if not self._next:  # Anthropic never answers without a block: an empty text block, as in JSON
                out += [*self._started(_Block(_TEXT, _TEXT_BLOCK, [])), *self._close()]
            return [
                *out,
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence},
                    # Cumulative totals: the SDK overwrites message_start's counts with these.
                    "usage": usage_object(event.usage),
                },
                {"type": "message_stop"},
            ]
        return []

    def _after_text(self) -> list[dict]:
        """The reasoning that waited for the text to end, as its own block after it."""
        late, self._late = self._late, None
        return [*self._close(), *self._started(late)] if late is not None else []

    def _arrived(self, key: int, start: dict | None, piece: str = "") -> list[dict]:
        """A block's start (`start`, with a first piece for text) or a tool call's next piece (`start` None)."""
        block = self._open
        if block is not None and block.key == key:
            if not piece:
                return []
            if key >= 0:  # a call's arguments so far, to tell when they are whole
                block.pieces.append(piece)
            return [self._delta(block, piece), *self._released()]
        if key in self._held:
            self._held[key].pieces.append(piece)
            return []
        if start is None:  # a piece of a call that was never started, or is closed: no block can take it
            return []
        block = _Block(key, start, [piece] if piece else [])
        if not self._closable():
            self._held[key] = block
            return []
        return [*self._close(), *self._started(block)]

    def _checked(self, index: int, piece: str) -> str:
        """A call's next piece of arguments as it may be sent. The SDK parses the pieces so far after each one and
        fails on any that are not the beginning of JSON, and a tool_use block's input is an object: arguments that
        stop being the beginning of one (the model wrote invalid JSON) end the stream with an error here, as the
        pieces already sent cannot be taken back. Whitespace before the object, which the SDK cannot parse alone,
        is left out."""
        name, arguments = self._calls.setdefault(index, ("", JsonObjectPrefix()))
        started = arguments.started
        if not arguments.feed(piece):
            raise UpstreamError(f"The upstream model wrote arguments for the tool call {name[:40]!r} that are not a "
                                "JSON object; the answer cannot be streamed as a tool_use block.")
        return piece if started else piece.lstrip(WHITESPACE)

    def _released(self) -> list[dict]:
        """The held blocks that can leave now that the open one may be done, each one after the other."""
        out: list[dict] = []
        while self._held and self._closable():
            key = next(iter(self._held))
            out += [*self._close(), *self._started(self._held.pop(key))]
        return out

    def _closable(self) -> bool:
        block = self._open
        return block is None or block.key < 0 or wire_json.is_json("".join(block.pieces))

    def _started(self, block: _Block) -> list[dict]:
        """Opens `block` (the open one must be closed) with its pieces so far, as one delta."""
        block.index, self._open = self._next, block
        self._next += 1
        out = [{"type": "content_block_start", "index": block.index, "content_block": block.start}]
        if block.index == 0:
            out.append({"type": "ping"})  # where Anthropic sends it: after the first block starts
        if block.pieces:
            out.append(self._delta(block, "".join(block.pieces)))
        return out

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open.index, None
        return [{"type": "content_block_stop", "index": index}]

    @staticmethod
    def _delta(block: _Block, piece: str) -> dict:
        if block.key == _TEXT:
            delta = {"type": "text_delta", "text": piece}
        elif block.key == _THINKING:
            delta = {"type": "thinking_delta", "thinking": piece}
        else:
            delta = {"type": "input_json_delta", "partial_json": piece}
        return {"type": "content_block_delta", "index": block.index, "delta": delta}
