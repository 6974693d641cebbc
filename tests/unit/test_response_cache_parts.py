"""The response cache's pure parts: the key, the event codec, the in-process store's expiry and size bound, the
memory an answer too large to keep holds while it is relayed."""

from __future__ import annotations

import tracemalloc

from server.cache import Lookup, ResponseCache, cache_key
from server.cache.codec import decode, encode
from server.cache.stores import MemoryStore
from server.domain_models import CacheSettings
from server.domain import AnthropicMessagesSource, Dialect, GenerationRequest, OpenAIChatSource, SamplingParams
from server.domain_answers import (
    FinishReason, Finished, Started, TextDelta, ToolCallDelta, ToolCallStart, UpstreamObject, Usage,
)


def request(body: dict, *, stream: bool = False, source=OpenAIChatSource) -> GenerationRequest:
    return GenerationRequest(turns=(), params=SamplingParams(max_tokens=8), source=source(body),
                             stream=stream)


def test_the_key_ignores_labels_and_key_order_but_not_what_shapes_the_answer():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
    key = cache_key("m", "s", "/v1/chat/completions", "key_1", request(base))
    assert cache_key("m", "s", "/v1/chat/completions", "key_1", request(
        {"user": "u", "metadata": {"a": 1}, **dict(reversed(list(base.items())))})) == key
    assert cache_key("m", "s", "/v1/chat/completions", "key_2", request(base)) != key  # another key
    assert cache_key("m", "t", "/v1/chat/completions", "key_1", request(base)) != key  # served by another upstream
    assert cache_key("m", "s", "/v1/chat/completions", "key_1", request(base, stream=True)) != key
    assert cache_key("m", "s", "/v1/chat/completions", "key_1", request({**base, "temperature": 0.3})) != key
    assert cache_key("m", "s", "/v1/chat/completions", "key_1", request({**base, "new_field": 1})) != key
    beta = AnthropicMessagesSource(base, beta=("tools-2024",))
    assert cache_key("m", "s", "/v1/messages", "k", GenerationRequest((), SamplingParams(8), source=beta)) != \
        cache_key("m", "s", "/v1/messages", "k", request(base, source=AnthropicMessagesSource))


def test_every_event_survives_the_codec():
    events = (Started(3), UpstreamObject(Dialect.OPENAI, {"id": "x", "choices": []}, True), TextDelta("hé"),
              ToolCallStart(0, "call_1", "f"), ToolCallDelta(0, '{"a":'),
              Finished(FinishReason.TOOL_USE, Usage(3, 4, 1), None, "tool_calls"))
    assert decode(encode(events, 1790000000.5)) == (1790000000.5, events)
    # An entry stored before the upstream's own reason was kept (by a host not yet upgraded) still reads.
    older = b'{"at":1.0,"events":[["f","end_turn",1,2,0,null]]}'
    assert decode(older) == (1.0, (Finished(FinishReason.END_TURN, Usage(1, 2, 0)),))


async def test_memory_store_expires_and_keeps_within_its_size():
    now = [0.0]
    store = MemoryStore(max_bytes=10, clock=lambda: now[0])
    await store.put("a", b"12345", 1.0)
    await store.put("b", b"12345", 1.0)
    assert await store.get("a") == b"12345"  # now the most recently used
    await store.put("c", b"123", 1.0)  # over 10 bytes: the least recently used ("b") goes
    assert await store.get("b") is None and await store.get("a") == b"12345"
    now[0] = 1.0
    assert await store.get("a") is None
    await store.put("big", b"x" * 11, 1.0)
    assert await store.get("big") is None


async def test_an_answer_past_max_entry_bytes_is_not_held_while_it_streams():
    """Every event was held until the answer's end, and only then measured against max_entry_bytes: a 20,000-token
    stream held ~40 MB (an uncached one ~0), whatever the bound, for each such stream at once. Now what is kept is
    one buffer of bytes, at most the bound (orjson's output for each event takes 4 kB however small: kept apart,
    100 kB of events took 4 MB), and nothing once past it."""
    store = MemoryStore()
    cache = ResponseCache(store)

    async def answer():
        for i in range(20_000):
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": f" word{i}"}, "finish_reason": None}]}
            yield UpstreamObject(Dialect.OPENAI, chunk, True)
            yield TextDelta(f" word{i}")
        yield Finished(FinishReason.END_TURN, Usage(1, 20_000))

    relayed = 0
    tracemalloc.start()
    try:
        async for _ in cache.recorded(Lookup("k", CacheSettings(max_entry_bytes=100_000), None, True), answer()):
            relayed += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert relayed == 40_001 and await store.get("k") is None
    assert peak < 300_000, peak  # 112 kB measured
    small = (TextDelta("hi"), Finished(FinishReason.END_TURN, Usage(1, 1)))

    async def short():
        for event in small:
            yield event

    assert [event async for event in cache.recorded(Lookup("s", CacheSettings(), None, True), short())] == \
        list(small)
    assert decode(await store.get("s"))[1] == small
