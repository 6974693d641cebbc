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


async def test_a_second_cancel_still_waits_until_the_source_is_closed():
    """grpc may cancel a leaving caller's task more than once: the source must be closed before the consumer ends,
    or whoever closes what the source reads from next finds it still running (a 500 for a caller who left)."""
    closed = []

    async def slow_to_close():
        try:
            yield b"a"
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.05)  # e.g. settling the rate limits
            closed.append(True)

    async def consume():
        async for _ in coalesced(slow_to_close()):
            pass

    consumer = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    consumer.cancel()
    await asyncio.sleep(0.01)  # the consumer now waits for the reader to stop
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert closed == [True]
