"""A cached answer is the provider's events, as one compact JSON document: replaying them through the same renderers
gives the caller the same framing (a JSON body, or the dialect's SSE stream), the upstream's own objects included.
The wall-clock time it was stored goes with it, for a caller's `Cache-Control: max-age` (hosts sharing Redis share it).
"""

from __future__ import annotations

from collections.abc import Sequence

from server import wire_json
from server.domain import Dialect, Thought
from server.domain_answers import (
    FinishReason, Finished, GenerationEvent, ReasoningDelta, Started, TextDelta, ToolCallDelta, ToolCallStart,
    UpstreamObject, Usage,
)


def encode(events: Sequence[GenerationEvent], stored_at: float) -> bytes:
    return entry(b",".join(encode_event(event) for event in events), stored_at)


def encode_event(event: GenerationEvent) -> bytes:
    """One event's part of an entry: a stream's are encoded as they pass, so only bytes are held until its end."""
    return wire_json.dumps(_encoded(event))


def entry(events: bytes | bytearray, stored_at: float) -> bytes:
    """The entry of encoded events joined by commas: {"at": stored_at, "events": [...]}."""
    return b'{"at":' + wire_json.dumps(stored_at) + b',"events":[' + events + b"]}"


def decode(data: bytes) -> tuple[float, tuple[GenerationEvent, ...]]:
    """(when it was stored, its events)"""
    entry = wire_json.loads(data)
    return float(entry["at"]), tuple(_decoded(item) for item in entry["events"])


def _encoded(event: GenerationEvent) -> list:
    if isinstance(event, TextDelta):
        return ["t", event.text]
    if isinstance(event, ReasoningDelta):
        return ["r", event.text]
    if isinstance(event, UpstreamObject):
        return ["u", event.dialect.value, event.payload, event.content]
    if isinstance(event, Started):
        return ["s", event.input_tokens]
    if isinstance(event, ToolCallStart):
        return ["c", event.index, event.id, event.name]
    if isinstance(event, ToolCallDelta):
        return ["a", event.index, event.arguments]
    if isinstance(event, Thought):
        return ["b", event.text, event.signature, event.redacted]
    if isinstance(event, Finished):
        usage = event.usage
        return ["f", event.reason.value, usage.input_tokens, usage.output_tokens, usage.cached_input_tokens,
                event.stop_sequence, event.upstream_reason]
    raise TypeError(f"cannot cache a {type(event).__name__}")


def _decoded(item: list) -> GenerationEvent:
    tag = item[0]
    if tag == "t":
        return TextDelta(item[1])
    if tag == "r":
        return ReasoningDelta(item[1])
    if tag == "u":
        return UpstreamObject(Dialect(item[1]), item[2], item[3])
    if tag == "s":
        return Started(item[1])
    if tag == "c":
        return ToolCallStart(item[1], item[2], item[3])
    if tag == "a":
        return ToolCallDelta(item[1], item[2])
    if tag == "b":
        return Thought(item[1], item[2], item[3])
    if tag == "f":
        # An entry stored before upstream reasons were kept has none (item[6]).
        return Finished(FinishReason(item[1]), Usage(item[2], item[3], item[4]), item[5], *item[6:7])
    raise ValueError(f"unknown cached event {tag!r}")
