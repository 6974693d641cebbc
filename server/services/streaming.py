"""Streamed HTTP answers: failures after the first byte become an SSE event (the caller already has a 200), and
frames that are ready together leave together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from server.errors import InternalError, PorticoError
from server.observability.record import RequestRecord

_logger = logging.getLogger(__name__)


async def guard_stream(
    frames: AsyncIterator[bytes], error_frame: Callable[[PorticoError], bytes], record: RequestRecord,
) -> AsyncIterator[bytes]:
    """Pass frames through; on failure end with the dialect's error event, `error_frame(error)`, noted on
    `record` unless the upstream's events already noted theirs (a failure in rendering them, too, is one)."""
    try:
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except Exception as exc:  # noqa: BLE001 - the stream must end with an error event, whatever failed
        if not isinstance(exc, PorticoError):
            _logger.exception("stream failed")
            exc = InternalError("The server had an error while streaming the response.")
        if not record.in_band_error:
            record.in_band_error = exc.kind.code
        yield error_frame(exc)


async def coalesced(frames: AsyncIterator[bytes], *, read_ahead: int = 64,
                    last: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The same bytes, with the frames that are ready together joined into one message.

    A helper task reads ahead while the previous message is being sent, so frames that arrive together (a burst
    from the upstream, or everything that piled up while the machine was busy) leave as one gRPC message and one
    HTTP chunk instead of one each: a message's trip through grpc and Envoy, not its bytes, is what a stream spends
    its CPU on. Nothing waits for company: a lone frame goes out as soon as it is ready. At most `read_ahead`
    frames are held, so a slow caller still holds back the upstream. `last` is called before the message that
    ends the stream is handed over.
    """
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(read_ahead)
    failure: list[Exception] = []

    async def read() -> None:
        try:
            async with aclosing(frames):
                async for frame in frames:
                    await queue.put(frame)
        except Exception as exc:  # noqa: BLE001 - handed over to the consumer, raised there
            failure.append(exc)
        await queue.put(None)

    reader = asyncio.create_task(read())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            ended = batch[-1] is None
            if ended:
                batch.pop()
                if last is not None:
                    last()
            if batch:
                yield b"".join(batch)
            if ended:
                if failure:
                    raise failure[0]
                return
    finally:
        reader.cancel()  # the caller went away: stop reading, and close the frames' source
        await _outlive_cancellation(reader)


async def _outlive_cancellation(task: asyncio.Task) -> None:
    """Wait until `task` has ended even if this one is cancelled again meanwhile (then re-raised): whoever closes
    the source next must not find the task still inside it."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled():
        task.exception()  # retrieved: never "Task exception was never retrieved"
    if cancelled:
        raise asyncio.CancelledError
