"""The server-sent events of an Anthropic Messages stream -> internal events, event by event; and a non-streamed
answer (one `message` object) -> the same events.

Pure: fed one decoded event at a time, it returns the internal events it completes, so nothing is buffered.
Thinking blocks' text makes ReasoningDeltas (a chat caller's `reasoning_content`) as it comes; each signed thinking
block, once it ends, and each redacted one also make a Thought, the whole block (a chat caller's `thinking_blocks`,
to give back): only the text of the block being read is held. A caller of the same dialect gets them all with the
upstream's own events (server/domain_answers.py UpstreamObject).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from server import wire_json
from server.domain import Json, Thought, estimate_tokens
from server.domain_answers import (
    CallIds, FinishReason, Finished, GenerationEvent, ReasoningDelta, Started, TextDelta, ToolCallDelta, ToolCallStart,
    UpstreamAnswer, Usage, numbered_call_ids, turn_end,
)
from server.errors import UpstreamError
from server.translate.usage_counts import MAX_TOKEN_COUNT, not_a_count, reported_count, token_count
from server.translate.values import MALFORMED, upstream_label, upstream_string

MAX_SEARCHES = 100_000  # at $1,000,000 a search (the dearest price), a cost far inside the ledger's BIGINT
_INPUT_COUNTS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")  # together, the prompt

STOP_REASONS = {
    "end_turn": FinishReason.END_TURN,
    "max_tokens": FinishReason.MAX_TOKENS,
    "stop_sequence": FinishReason.STOP_SEQUENCE,
    "tool_use": FinishReason.TOOL_USE,
    "refusal": FinishReason.REFUSAL,
    "pause_turn": FinishReason.END_TURN,
    "model_context_window_exceeded": FinishReason.CONTEXT_WINDOW,
}


class AnthropicEventReader:
    """`prompt_estimate`: what the prompt counts when the upstream reports no input tokens (an Anthropic-compatible
    server without usage); its answer then counts four characters a token, as an OpenAI-compatible one's does."""

    def __init__(self, *, prompt_estimate: int = 0, call_ids: CallIds = numbered_call_ids("toolu_"),
                 thoughts: bool = True) -> None:
        """`call_ids`: ids for tool_use blocks the upstream sends without one (a provider's are random, unique
        across answers). `thoughts`: make the whole thinking blocks' Thoughts too; a caller of Anthropic's own
        dialect gets the upstream's events whole, so its stream need not hold a block's text while it is read."""
        self._prompt_estimate = prompt_estimate
        self._thoughts = thoughts
        self._call_ids = call_ids
        self._input_reported = False
        self._output_final = False  # message_delta reported the answer's output tokens (message_start's is a start)
        self._chars = 0  # of text, thinking and tool input, for an answer whose usage says nothing of its output
        self._tool_blocks: dict[int, int] = {}  # content block index -> tool call index
        self._tool_inputs: set[int] = set()  # tool calls whose input has had any text
        self._thinking: tuple[int, list[str]] | None = None  # the thinking block being read: its index, its text
        self._signature = ""  # ... and its signature
        self._input_tokens = 0
        self._output_tokens = 0
        self._cached_tokens = 0  # read from the prompt cache (priced as cached input)
        self._written_tokens = 0  # written to it (priced as cache writes)
        self._written_1h_tokens = 0  # of those, written for an hour (priced as cache_write_1h)
        self._searches = 0  # by its web search tool (priced per search)
        self._reason = FinishReason.END_TURN
        self._upstream_reason = ""
        self._stop_sequence: str | None = None
        self.finished = False

    def feed(self, event: Mapping[str, Json]) -> list[GenerationEvent]:
        """The events `event` completes; an event that is JSON but not the Messages API's (a number where text
        belongs, an index that is no number) is the upstream's fault, an UpstreamError, not a crash further on."""
        try:
            kind = upstream_string(event.get("type"))  # a same-dialect caller gets it on an `event:` line
            if "\n" in kind or "\r" in kind:  # ... where a line break would start lines of the upstream's making
                raise ValueError("a line break in an event's type")
            if kind == "message_start":
                message = event.get("message")
                usage = _mapping(message.get("usage") if isinstance(message, Mapping) else None)
                self._input_tokens = _input_tokens(usage)
                self._cached_tokens = token_count(usage, "cache_read_input_tokens")
                self._written_tokens = token_count(usage, "cache_creation_input_tokens")
                self._written_1h_tokens = _reported_hour_writes(usage)
                self._output_tokens = token_count(usage, "output_tokens")
                self._note_reported(usage)
                # The cache's share too: a stream cut short is settled with what came, and these tokens cost their
                # own prices (a read a tenth of the input price), not the input price.
                if not self._input_reported:
                    return [Started(self._prompt_estimate)]
                return [Started(self._input_tokens, self._cached_tokens, self._written_tokens, self._hour_writes())]
            if kind == "content_block_start":
                return self._counted(self._block_start(int(event.get("index", 0)), event.get("content_block") or {}))
            if kind == "content_block_delta":
                delta = event.get("delta") or {}
                return self._counted(self._block_delta(int(event.get("index", 0)), delta))
            if kind == "message_delta":
                delta = event.get("delta") or {}
                if reason := delta.get("stop_reason"):
                    self._reason = STOP_REASONS.get(reason, FinishReason.END_TURN)
                    self._upstream_reason = upstream_label(reason)
                self._stop_sequence = delta.get("stop_sequence")
                usage = _mapping(event.get("usage"))
                self._output_tokens = token_count(usage, "output_tokens") or self._output_tokens
                self._output_final = self._output_final or usage.get("output_tokens") is not None
                self._note_reported(usage)
                self._searches = max(self._searches, _web_searches(usage))  # cumulative, as the other counts
                if "input_tokens" in usage and usage["input_tokens"] is not None:  # newer APIs repeat the final count
                    # Cumulative, so never below message_start's: SGLang's endpoint sends 0 here after the count there
                    # (z.ai's and LiteLLM's send 0 there and the count here).
                    self._input_tokens = max(self._input_tokens, _input_tokens(usage))
                    self._cached_tokens = max(self._cached_tokens, token_count(usage, "cache_read_input_tokens"))
                    self._written_tokens = max(self._written_tokens, token_count(usage, "cache_creation_input_tokens"))
                    self._written_1h_tokens = max(self._written_1h_tokens, _reported_hour_writes(usage))
                return []
            if kind == "content_block_stop":
                return self._block_stop(int(event.get("index", 0)))
            if kind == "message_stop":
                self.finished = True
                # message_start's output count is where the answer starts (Anthropic's 1, MiniMax's 0): without
                # message_delta's, which MiniMax leaves out, the answer is estimated, never counted below that start.
                output = (self._output_tokens if self._output_final
                          else max(self._output_tokens, estimate_tokens(self._chars)))
                usage = Usage(self._input_tokens if self._input_reported else self._prompt_estimate, output,
                              self._cached_tokens, self._written_tokens, self._hour_writes(), self._searches)
                # A chat caller is told `tool_calls` exactly when there are calls (compatible bridges say otherwise).
                reason = turn_end(self._reason, calls=bool(self._tool_blocks))
                return [Finished(reason, usage, self._stop_sequence, self._upstream_reason)]
            return []  # ping and event types added later
        except MALFORMED:
            raise UpstreamError("The upstream sent an event that is not a Messages API event.") from None

    def _counted(self, events: list[GenerationEvent]) -> list[GenerationEvent]:
        self._chars += sum(len(e.arguments) if isinstance(e, ToolCallDelta) else len(e.text)
                           for e in events if isinstance(e, (TextDelta, ReasoningDelta, ToolCallDelta)))
        return events

    def _note_reported(self, usage: Mapping[str, Json]) -> None:
        self._input_reported = self._input_reported or any(usage.get(name) is not None for name in _INPUT_COUNTS)

    def _block_start(self, index: int, block: Mapping[str, Json]) -> list[GenerationEvent]:
        if block.get("type") == "text":
            return [TextDelta(upstream_string(block["text"]))] if block.get("text") else []
        if block.get("type") == "thinking":  # a whole answer's block holds its thinking; a stream's starts empty
            text = upstream_string(block.get("thinking") or "")
            if self._thoughts:
                self._thinking, self._signature = (index, [text]), upstream_string(block.get("signature") or "")
            return [ReasoningDelta(text)] if text else []
        if block.get("type") == "redacted_thinking" and block.get("data") and self._thoughts:
            return [Thought(redacted=upstream_string(block["data"]))]
        if block.get("type") == "tool_use":
            call = self._tool_blocks[index] = len(self._tool_blocks)
            # A compatible server's block without an id (or with null) gets one, as a chat caller must name the call
            # in its result and Anthropic refuses an empty id there; never the text "None".
            call_id, name = block.get("id"), block.get("name")
            call_id = str(call_id) if call_id not in (None, "") else self._call_ids(call)
            events: list[GenerationEvent] = [ToolCallStart(call, call_id, "" if name is None else str(name))]
            if block.get("input"):  # Anthropic streams the input as deltas; some compatible servers send it here
                self._tool_inputs.add(call)
                events.append(ToolCallDelta(call, wire_json.dumps(block["input"]).decode()))
            return events
        return []

    def _block_delta(self, index: int, delta: Mapping[str, Json]) -> list[GenerationEvent]:
        if delta.get("type") == "text_delta" and delta.get("text"):
            return [TextDelta(upstream_string(delta["text"]))]
        if delta.get("type") == "thinking_delta" and delta.get("thinking"):
            text = upstream_string(delta["thinking"])
            if self._thinking is not None and self._thinking[0] == index:
                self._thinking[1].append(text)
            return [ReasoningDelta(text)]
        if delta.get("type") == "signature_delta" and self._thinking is not None and self._thinking[0] == index:
            self._signature += upstream_string(delta.get("signature") or "")
        if delta.get("type") == "input_json_delta" and index in self._tool_blocks and delta.get("partial_json"):
            self._tool_inputs.add(self._tool_blocks[index])
            return [ToolCallDelta(self._tool_blocks[index], upstream_string(delta["partial_json"]))]
        return []

    def _block_stop(self, index: int) -> list[GenerationEvent]:
        if self._thinking is not None and self._thinking[0] == index:
            text, signature = "".join(self._thinking[1]), self._signature
            self._thinking, self._signature = None, ""
            # Unsigned (a compatible server's), it cannot go back to Anthropic: its text was reasoning only.
            return [Thought(text, signature)] if signature else []
        # A tool without parameters streams its input {} as one empty delta (or none): its arguments must still be
        # the JSON text "{}", as in the whole answer and as OpenAI sends them, not "" (which json.loads refuses).
        call = self._tool_blocks.get(index)
        if call is None or call in self._tool_inputs:
            return []
        self._tool_inputs.add(call)
        return [ToolCallDelta(call, "{}")]

    def reported(self) -> Usage | None:
        """The usage the upstream reported for the whole answer (message_delta's), for a stream that then breaks
        off before message_stop; None before it (message_start's output count is only where the answer starts)."""
        if not self._output_final:
            return None
        return Usage(self._input_tokens if self._input_reported else self._prompt_estimate, self._output_tokens,
                     self._cached_tokens, self._written_tokens, self._hour_writes(), self._searches)

    def _hour_writes(self) -> int:
        """Part of the writes, never more (a compatible server's breakdown that disagrees with its total)."""
        return min(self._written_1h_tokens, self._written_tokens)

    def end(self) -> None:
        """The stream ended: fine after message_stop, an upstream error before it."""
        if not self.finished:
            raise UpstreamError("The upstream's stream ended before the answer was complete.", retry_reason="broken")


def message_events(message: Mapping[str, Json], *, prompt_estimate: int = 0,
                   call_ids: CallIds = numbered_call_ids("toolu_")) -> list[GenerationEvent]:
    """A whole `message` -> the events AnthropicEventReader makes of the same answer streamed: it is read as the
    stream Anthropic would have sent (message_start with the usage, each content block started and stopped, a
    tool_use block's input as one input_json_delta, message_delta with the stop reason and usage, message_stop).
    One that cannot be used fails with the usage it reports, which the upstream billed (the ledger counts it, as a
    stream's that breaks off)."""
    try:
        return _message_events(message, prompt_estimate, call_ids)
    except UpstreamError as error:
        if error.usage_reported is None:
            usage = _mapping(message.get("usage"))
            reader = AnthropicEventReader(prompt_estimate=prompt_estimate)
            with contextlib.suppress(UpstreamError):  # a usage that is no count is none
                reader.feed({"type": "message_start", "message": {"usage": usage}})
                reader.feed({"type": "message_delta", "usage": usage, "delta": {}})
                error.usage_reported = reader.reported()
        raise


def _message_events(message: Mapping[str, Json], prompt_estimate: int,
                    call_ids: CallIds) -> list[GenerationEvent]:
    content = message.get("content")
    if (message.get("type", "message") != "message" or not isinstance(content, list)
            or not all(isinstance(block, Mapping) for block in content)):
        raise UpstreamError("The upstream's answer is not a message.")
    usage = message.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    reader = AnthropicEventReader(prompt_estimate=prompt_estimate, call_ids=call_ids)
    events = reader.feed({"type": "message_start", "message": {"usage": usage}})
    for index, block in enumerate(content):
        if block.get("type") == "tool_use":
            events += reader.feed({"type": "content_block_start", "index": index,
                                   "content_block": {**block, "input": {}}})
            # A null input is none, {}, as the same block streamed gives it (never the arguments "null").
            tool_input = block["input"] if block.get("input") is not None else {}
            events += reader.feed({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": wire_json.dumps(tool_input).decode()}})
        else:
            events += reader.feed({"type": "content_block_start", "index": index, "content_block": block})
        events += reader.feed({"type": "content_block_stop", "index": index})
    events += reader.feed({"type": "message_delta", "usage": usage, "delta": {
        "stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}})
    events += reader.feed({"type": "message_stop"})
    return events


def anthropic_answer(answer: Mapping[str, Json]) -> UpstreamAnswer:
    """What a `message`, or one streamed event, says of the answer: a message (message_start's too) its id, model and
    usage; message_delta its stop reason and final usage; other events nothing. Read after the reader took it."""
    kind = answer.get("type")
    message = _mapping(answer.get("message")) if kind == "message_start" else answer
    reason = _mapping(answer.get("delta")).get("stop_reason") if kind == "message_delta" else message.get("stop_reason")
    usage = _mapping(message.get("usage"))
    reported = any(usage.get(name) is not None for name in _INPUT_COUNTS)
    return UpstreamAnswer(upstream_label(message.get("id"), 256), upstream_label(message.get("model"), 256),
                          upstream_label(reason), _input_tokens(usage) if reported else None,
                          reported_count(usage, "output_tokens"))


def carries_content(event: Mapping[str, Json]) -> bool:
    """Whether an event carries part of the answer (any block delta, a block that starts with content, such as
    redacted thinking or a server tool's result), rather than only framing, a ping or usage."""
    kind = event.get("type")
    if kind == "content_block_delta":
        return True
    if kind == "content_block_start":
        block = event.get("content_block")
        block = block if isinstance(block, Mapping) else {}
        return block.get("type") not in ("text", "thinking") or bool(block.get("text") or block.get("thinking"))
    return False


def _mapping(value: Json) -> Mapping[str, Json]:
    """A usage object; anything else (absent, null, not an object) says nothing."""
    return value if isinstance(value, Mapping) else {}


def _reported_hour_writes(usage: Mapping[str, Json]) -> int:
    """The prompt tokens written to the cache for an hour, which Anthropic bills above the five-minute writes: newer
    API versions split `cache_creation_input_tokens` by TTL in `cache_creation`; without it, all are 5 minutes'."""
    return token_count(_mapping(usage.get("cache_creation")), "ephemeral_1h_input_tokens")


def _web_searches(usage: Mapping[str, Json]) -> int:
    """Searches by Anthropic's web search server tool, billed per search. A count no request makes is not the API's
    usage: priced per search, it could overflow the ledger's cost."""
    count = token_count(_mapping(usage.get("server_tool_use")), "web_search_requests")
    if count > MAX_SEARCHES:
        raise not_a_count(f"The upstream's usage is not a count of searches: `web_search_requests` is {count}.")
    return count


def _input_tokens(usage: Mapping[str, Json]) -> int:
    """Prompt caching splits the prompt three ways; all of it was read, so all of it counts against the limits."""
    total = sum(token_count(usage, name) for name in _INPUT_COUNTS)
    if total > MAX_TOKEN_COUNT:
        raise not_a_count(f"The upstream's usage is not a token count: its prompt is {total} tokens.")
    return total
