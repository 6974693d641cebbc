"""Cutoff.outlast: a model call's cancellation is taken back once, when it is its caller's leaving; never the cut's,
never a second one, never outside a model call; and a drain can wait for the calls that run on."""

from __future__ import annotations

import asyncio

from server.cutoff import Cutoff


async def _call(cutoff: Cutoff, answer: asyncio.Future, seen: list[str], *, watched: bool = True) -> str:
    """A model call waiting on its answer as http_connection.Response does: a cancellation it may outlast is taken
    back and it waits again."""

    async def wait() -> str:
        while True:
            try:
                return await asyncio.shield(answer)
            except asyncio.CancelledError:
                if not cutoff.outlast():
                    raise
                seen.append(f"ran on, caller_left={cutoff.caller_left()}")

    if not watched:
        return await wait()
    with cutoff.watch(billed=True) as watch:
        watch.begin()
        return await wait()


async def test_the_callers_leaving_is_outlasted_once_and_the_cut_is_not():
    cutoff, answer, seen = Cutoff(), asyncio.get_running_loop().create_future(), []
    call = asyncio.ensure_future(_call(cutoff, answer, seen))
    await asyncio.sleep(0)
    call.cancel()  # the caller left
    await asyncio.sleep(0)
    assert seen == ["ran on, caller_left=True"] and not call.done()
    drained = asyncio.ensure_future(cutoff.ended())
    await asyncio.sleep(0)
    assert not drained.done()  # a drain waits for it
    call.cancel()  # a second cancellation (grpc's at the end of the drain) is not taken back
    await asyncio.sleep(0)
    assert call.cancelled()
    await asyncio.wait_for(drained, 1)


async def test_the_answer_arrives_after_the_caller_left():
    cutoff, answer, seen = Cutoff(), asyncio.get_running_loop().create_future(), []
    call = asyncio.ensure_future(_call(cutoff, answer, seen))
    await asyncio.sleep(0)
    call.cancel()
    await asyncio.sleep(0)
    answer.set_result("whole")
    assert await call == "whole"
    await asyncio.wait_for(cutoff.ended(), 1)


async def test_nothing_is_outlasted_once_cut_or_outside_a_model_call():
    cutoff, seen = Cutoff(), []
    loop = asyncio.get_running_loop()
    unwatched = asyncio.ensure_future(_call(cutoff, loop.create_future(), seen, watched=False))
    await asyncio.sleep(0)
    unwatched.cancel()
    await asyncio.sleep(0)
    assert unwatched.cancelled()
    watched = asyncio.ensure_future(_call(cutoff, loop.create_future(), seen))
    await asyncio.sleep(0)
    cutoff.cut()  # cancels the waiting call: the cut's cancellation, never taken back
    await asyncio.sleep(0)
    assert watched.cancelled() and seen == []
