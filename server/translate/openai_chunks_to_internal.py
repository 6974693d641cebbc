"""The chat.completion.chunk objects an OpenAI-compatible upstream streams -> internal events, chunk by chunk; and
its non-streamed answer (one chat.completion) -> the same events.

Pure: fed one decoded chunk at a time, it returns the events that chunk completes, so nothing is buffered. The
finish reason arrives one chunk before the usage (stream_options.include_usage), so Finished is made by `end()`.
Servers that ignore include_usage (llama-cpp-python's) send no usage: it is then estimated, one token per
streamed delta, which is what those servers send; so is a count a usage leaves out or sends as null.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from server.domain import Json, estimate_tokens
from server.domain_answers import (
    CallIds, FinishReason, Finished, GenerationEvent, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart,
    UpstreamAnswer, Usage, numbered_call_ids, turn_end,
)
from server import wire_json
from server.errors import UpstreamError
from server.translate.usage_counts import reported_count, token_count
from server.translate.values import MALFORMED, upstream_label, upstream_string

FINISH_REASONS = {
    "stop": FinishReason.END_TURN,
    "length": FinishReason.MAX_TOKENS,
    "model_length": FinishReason.CONTEXT_WINDOW,  # Mistral's: the context window filled before the token limit
    "tool_calls": FinishReason.TOOL_USE,
    "function_call": FinishReason.TOOL_USE,
    "content_filter": FinishReason.REFUSAL,
}
# Finish reasons that say the generation failed, not that it ended: Mistral's `error`, vLLM's `abort` (the engine gave
# the request up: shut down, paused, scaled in). The text before it is no answer, whatever the 200 and [DONE] say.
FAILED_REASONS = frozenset({"error", "abort"})


class OpenAIChunkReader:
    def __init__(self, *, prompt_estimate: int, stop: tuple[str, ...] = (),
                 call_ids: CallIds = numbered_call_ids("call_")) -> None:
        """`call_ids`: ids for calls the upstream sends without one (a provider's are random, unique across
        answers)."""
        self._prompt_estimate = prompt_estimate
        self._stop = stop
        self._call_ids = call_ids
        self._calls: dict[int, int] = {}  # the upstream's tool-call index -> ours (0, 1, ... in order of arrival)
        self._ids: list[str] = []  # by ours: the id the upstream gave the call ("" when none)
        # Calls opened without a name yet (ours -> their id and the argument pieces held meanwhile): some servers
        # send the name in a later piece, and a Messages block names its tool in its start.
        self._unnamed: dict[int, tuple[str, list[str]]] = {}
        self._last: Json = None  # the upstream's index (or ours, for a call it numbers not) of the last call piece
        self._deltas = 0
        self._finish: FinishReason | None = None
        self._stop_sequence: str | None = None
        self._upstream_reason = ""
        # The counts its usage reported (None: not said, as by servers that send `usage: {}` on every chunk)
        self._prompt: int | None = None
        self._output: int | None = None
        self._cached = 0
        self._refused = False  # the model refused (OpenAI's `refusal`), whatever the finish reason says

    def feed(self, chunk: Mapping[str, Json]) -> list[GenerationEvent]:
        """The events `chunk` completes; a chunk that is JSON but not a chat.completion.chunk (a number where text
        belongs, a list where usage does) is the upstream's fault, an UpstreamError, not a crash further on."""
        try:
            if isinstance(usage := chunk.get("usage"), Mapping):
                if isinstance(details := usage.get("prompt_tokens_details"), Mapping):
                    self._cached = token_count(details, "cached_tokens")
                # A count not said here (`usage: {}`, null) is not 0: the one said before stands, else an estimate.
                self._prompt = _said(reported_count(usage, "prompt_tokens"), self._prompt)
                self._output = _said(reported_count(usage, "completion_tokens"), self._output)
            events: list[GenerationEvent] = []
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue  # one choice per request (n = 1)
                delta = choice.get("delta") or {}
                # The reasoning before the answer: DeepSeek's, vLLM's and llama.cpp's `reasoning_content`, newer
                # vLLM's and OpenRouter's `reasoning` (one of them, where a server sends both alike).
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if isinstance(reasoning, str) and reasoning:
                    events.append(ReasoningDelta(reasoning))
                    self._deltas += 1
                # A string almost always: tested here, as _text's call would be paid by every chunk of every stream.
                if text := (content if isinstance(content := delta.get("content"), str) else _text(content)):
                    events.append(TextDelta(text))
                    self._deltas += 1
                if isinstance(refusal := delta.get("refusal"), str) and refusal:
                    # What the model said instead of answering: text to a caller of another dialect.
                    events.append(TextDelta(refusal))
                    self._deltas += 1
                    self._refused = True
                for call in delta.get("tool_calls") or ():
                    events += self._tool_call(call)
                if reason := choice.get("finish_reason"):
                    events += self._start_unnamed()
                    self._finish = FINISH_REASONS.get(reason, FinishReason.END_TURN)
                    self._upstream_reason = upstream_label(reason)
                    # vLLM names the stop string that ended the answer; OpenAI does not say, so it stays end_turn.
                    if reason == "stop" and choice.get("stop_reason") in self._stop:
                        self._finish, self._stop_sequence = FinishReason.STOP_SEQUENCE, choice["stop_reason"]
            return events
        except MALFORMED:
            raise UpstreamError("The upstream sent a chunk that is not a chat.completion.chunk.") from None

    def _tool_call(self, call: Mapping[str, Json]) -> list[GenerationEvent]:
        function = call.get("function") or {}
        name = upstream_string(function.get("name") or "")
        arguments = function.get("arguments") or ""
        if isinstance(arguments, Mapping):  # the object itself, as TGI and some llama.cpp servers send it: its text
            arguments = wire_json.dumps(arguments).decode()
        arguments = upstream_string(arguments)
        given_id = upstream_string(call.get("id") or "")
        upstream_index = call.get("index")
        if upstream_index is None:
            # Gemini's calls have no index: a piece that names a call (but for the last call's id) starts one, any
            # other continues the last (its arguments' next piece, or only its thought signature).
            last = len(self._ids) - 1
            if last >= 0 and (not name or given_id and given_id == self._ids[last]):
                upstream_index = self._last
            elif not (name or given_id or arguments):
                return []  # no call to continue, and nothing of one
            else:
                upstream_index = ("unnumbered", len(self._ids))
        self._last = upstream_index
        events: list[GenerationEvent] = []
        known = self._calls.get(upstream_index)
        # Ollama numbers every call of a parallel batch 0, each with its own id: another id with a name is another
        # call (a piece of arguments alone continues the call, whatever id a server writes on it).
        if known is None or name and given_id and self._ids[known] and given_id != self._ids[known]:
            events += self._start_unnamed()  # a call before this one still without a name: it starts first
            index = self._calls[upstream_index] = len(self._ids)
            self._ids.append(given_id)
            self._unnamed[index] = (given_id or self._call_ids(index), [])
        index = self._calls[upstream_index]
        if arguments:
            self._deltas += 1
        if index in self._unnamed:
            call_id, held = self._unnamed[index]
            if not name:  # its start waits for the name (or the next call, or the finish)
                held += [arguments] if arguments else []
                return events
            del self._unnamed[index]
            events.append(ToolCallStart(index, call_id, name))
            arguments = "".join(held) + arguments
        if arguments:
            events.append(ToolCallDelta(index, arguments))
        return events

    def _start_unnamed(self) -> list[GenerationEvent]:
        """The calls still waiting for a name, started without one (the upstream never sent it), in order."""
        events: list[GenerationEvent] = []
        for index, (call_id, held) in sorted(self._unnamed.items()):
            events.append(ToolCallStart(index, call_id, ""))
            if held:
                events.append(ToolCallDelta(index, "".join(held)))
        self._unnamed.clear()
        return events

    def reported(self) -> Usage | None:
        """The usage the upstream reported so far (its usage chunk), for a stream that then breaks off."""
        if self._prompt is None and self._output is None:
            return None
        return self._counted(self._deltas)

    @property
    def output_reported(self) -> bool:
        """Whether the upstream's usage said how long the answer was (else end() estimates it)."""
        return self._output is not None

    def _counted(self, output_estimate: int) -> Usage:
        """The usage reported, each count it left out estimated as when a server reports none."""
        prompt = self._prompt_estimate if self._prompt is None else self._prompt
        return Usage(prompt, output_estimate if self._output is None else self._output, min(self._cached, prompt))

    def end(self, output_estimate: int | None = None) -> Finished:
        """The stream ended ([DONE] or the connection closed cleanly): the final event, or an error if the
        upstream never said it finished. `output_estimate`: the answer's count when the upstream reports none
        (default: one token per streamed delta)."""
        if self._finish is None:
            raise UpstreamError("The upstream's stream ended before the answer was complete.", retry_reason="broken")
        if self._upstream_reason in FAILED_REASONS:
            error = UpstreamError(f"The upstream's generation failed (finish_reason `{self._upstream_reason}`).",
                                  retry_reason="broken")
            error.usage_reported = self.reported()  # what it spent on it, for the ledger
            raise error
        usage = self._counted(self._deltas if output_estimate is None else output_estimate)
        # OpenAI ends a refusal with "stop": Anthropic's callers are told `refusal`, as their upstreams would say
        # (and `tool_use` exactly when there are calls: the SDK's tool runner runs calls only on tool_use).
        if self._finish is FinishReason.END_TURN and self._refused:
            reason = FinishReason.REFUSAL
        else:
            reason = turn_end(self._finish, calls=bool(self._calls))
        return Finished(reason, usage, self._stop_sequence, self._upstream_reason)


def completion_events(completion: Mapping[str, Json], *, prompt_estimate: int, stop: tuple[str, ...] = (),
                      call_ids: CallIds = numbered_call_ids("call_")) -> list[GenerationEvent]:
    """A whole chat.completion -> the events OpenAIChunkReader makes of the same answer streamed.

    The completion is read as the one chunk that would carry all of it: each choice's message as its delta (the
    tool calls of a message have no `index`: the reader numbers them in order), its finish reason (and vLLM's
    stop_reason), and its usage. A completion without usage is estimated from its length (a token is about four
    characters), not from its one delta. One that cannot be used fails with the usage it reports, which the upstream
    billed (the ledger counts it, as a stream's that breaks off).
    """
    try:
        return _completion_events(completion, prompt_estimate, stop, call_ids)
    except UpstreamError as error:
        if error.usage_reported is None:
            reader = OpenAIChunkReader(prompt_estimate=prompt_estimate)
            with contextlib.suppress(UpstreamError):  # a usage that is no count is none
                reader.feed({"usage": completion.get("usage")})
                error.usage_reported = reader.reported()
        raise


def _completion_events(completion: Mapping[str, Json], prompt_estimate: int, stop: tuple[str, ...],
                       call_ids: CallIds) -> list[GenerationEvent]:
    choices = completion.get("choices")
    if not isinstance(choices, list) or not all(_is_choice(c) for c in choices):
        raise UpstreamError("The upstream's answer is not a chat completion.")
    if not any(c.get("index", 0) == 0 and c.get("finish_reason") for c in choices):
        # Whole, so not cut short (as a stream without one would be): asking again would get the same.
        raise UpstreamError("The upstream's answer has no finish reason.")
    # A message's calls are whole, each its own: numbered here, the reader does not take one for another's piece.
    chunk_choices = [{**choice, "delta": {**choice["message"], "tool_calls": [
        {**call, "index": i} for i, call in enumerate(choice["message"].get("tool_calls") or ())]}}
        for choice in choices]
    reader = OpenAIChunkReader(prompt_estimate=prompt_estimate, stop=stop, call_ids=call_ids)
    events = reader.feed({"choices": chunk_choices, "usage": completion.get("usage")})
    estimate = None
    if not reader.output_reported:  # counted from the answer's length (its one delta would say 1)
        estimate = estimate_tokens(sum(len(e.arguments) if isinstance(e, ToolCallDelta) else len(e.text)
                                       for e in events if isinstance(e, (TextDelta, ReasoningDelta, ToolCallDelta))))
    events.append(reader.end(estimate))
    return events


def openai_answer(answer: Mapping[str, Json]) -> UpstreamAnswer:
    """What a chat.completion, or one of its chunks, says of itself: its id and model (every chunk repeats them), the
    first choice's finish reason, the usage (the last chunk's). Read after the reader took it, so well formed."""
    reason = ""
    for choice in answer.get("choices") or ():
        if choice.get("index", 0) == 0:
            reason = upstream_label(choice.get("finish_reason"))
    usage = answer.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    return UpstreamAnswer(upstream_label(answer.get("id"), 256), upstream_label(answer.get("model"), 256), reason,
                          reported_count(usage, "prompt_tokens"), reported_count(usage, "completion_tokens"))


def carries_content(chunk: Mapping[str, Json]) -> bool:
    """Whether a chunk carries part of the answer (text, tool calls, or what no internal event holds, such as a
    reasoning or refusal delta), rather than only a role, a finish reason or usage."""
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, Mapping) else None
        if isinstance(delta, Mapping) and any(value for name, value in delta.items() if name != "role"):
            return True
    return False


def _said(count: int | None, before: int | None) -> int | None:
    return before if count is None else count


def _text(content: Json) -> str:
    """A delta's or message's content: a string, or (as some servers send it) a list of parts, whose text parts
    are the text."""
    if isinstance(content, list):
        return "".join(upstream_string(part.get("text")) for part in content if part.get("type") == "text")
    return upstream_string(content) if content else ""


def _is_choice(choice: Json) -> bool:
    if not isinstance(choice, Mapping) or not isinstance(message := choice.get("message"), Mapping):
        return False
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    # A list of parts, as Mistral's reasoning models answer (thinking, then text), is read as a delta's: its text.
    parts = isinstance(content, list) and all(isinstance(part, Mapping) for part in content)
    return ((isinstance(content, str) or parts) and isinstance(calls, list)
            and all(isinstance(call, Mapping) for call in calls))
