"""Streamed answers: frames that are ready together leave as one message, a lone frame is never held back, and a
caller that goes away stops the source."""

from __future__ import annotations

import asyncio

import pytest

from server.services.streaming import coalesced


async def _burst_then_trickle(gate: asyncio.Event, closed: list[bool]):
    try:
        for frame in (b"a", b"b", b"c"):  # ready at once
            yield frame
        await gate.wait()  # the next frame comes later
        yield b"d"
    finally:
        closed.append(True)


async def test_frames_ready_together_are_one_message_and_a_late_one_is_not_held_back():
    gate, closed = asyncio.Event(), []
    messages = coalesced(_burst_then_trickle(gate, closed))
    assert await anext(messages) == b"abc"
    later = asyncio.ensure_future(anext(messages))
    await asyncio.sleep(0.01)
    assert not later.done()  # nothing is sent before the source has it
    gate.set()
    assert await later == b"d"
    with pytest.raises(StopAsyncIteration):
        await anext(messages)
    assert closed == [True]


async def test_a_failure_of_the_source_reaches_the_consumer_after_what_came_before():
    async def failing():
        yield b"a"
        raise ValueError("boom")

    received = []
    with pytest.raises(ValueError, match="boom"):
        async for message in coalesced(failing()):
            received.append(message)
    assert received == [b"a"]


async def test_a_consumer_that_goes_away_closes_the_source():
    gate, closed = asyncio.Event(), []
    messages = coalesced(_burst_then_trickle(gate, closed))
    assert await anext(messages) == b"abc"
    await messages.aclose()  # what grpc does when the caller disconnects
    assert closed == [True]


async def test_the_source_is_read_only_so_far_ahead():
    produced = []

    async def endless():
        n = 0
        while True:
            produced.append(n)
            yield b"x"
            n += 1

    messages = coalesced(endless(), read_ahead=4)
    first = await anext(messages)
    await asyncio.sleep(0.01)
    assert len(first) <= 5 and len(produced) <= len(first) + 6
    await messages.aclose()
