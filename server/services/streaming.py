"""Streamed HTTP answers: failures after the first byte become an SSE event (the caller already has a 200), and
frames that are ready together leave together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from server.errors import InternalError, PorticoError
from server.observability.record import RequestRecord

_logger = logging.getLogger(__name__)


async def guard_stream(
    frames: AsyncIterator[bytes], error_frame: Callable[[PorticoError], bytes], record: RequestRecord,
) -> AsyncIterator[bytes]:
    """Pass frames through; on failure end with the dialect's error event, `error_frame(error)`, noted on
    `record` unless the upstream's events already noted theirs (a failure in rendering them, too, is one)."""
    try:
        try:
            async for frame in frames:
                yield frame
        finally:
            await frames.aclose()  # aclosing's work, without its objects held by every open stream
    except Exception as exc:  # noqa: BLE001 - the stream must end with an error event, whatever failed
        if not isinstance(exc, PorticoError):
            _logger.exception("stream failed")
            exc = InternalError("The server had an error while streaming the response.")
        elif exc.kind.http_status == 500:  # a bug the code caught itself: logged with its traceback, as any 500
            _logger.error("stream failed: %s", exc.message, exc_info=exc)
        if not record.in_band_error:
            record.in_band_error = exc.kind.code
        yield error_frame(exc)


class _ReadAhead:
    """Frames read ahead of their consumer, at most `limit` held. One side waits at a time (the reader only when
    the frames are full, the consumer only when there are none), so one future serves both: lighter than an
    asyncio.Queue (four deques and an Event), which every open stream held."""

    __slots__ = ("frames", "ended", "failure", "_limit", "_waiter")

    def __init__(self, limit: int) -> None:
        self.frames: list[bytes] = []
        self.ended = False
        self.failure: Exception | None = None
        self._limit = limit
        self._waiter: asyncio.Future[None] | None = None

    async def put(self, frame: bytes) -> None:
        while len(self.frames) >= self._limit:
            await self._wait()
        self.frames.append(frame)
        self._wake()

    def end(self, failure: Exception | None) -> None:
        self.ended, self.failure = True, failure
        self._wake()

    async def take(self) -> list[bytes]:
        """Every frame read so far (none only once the source has ended), making room for the reader."""
        while not self.frames and not self.ended:
            await self._wait()
        batch, self.frames = self.frames, []
        self._wake()
        return batch

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._waiter = None


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
    ahead = _ReadAhead(read_ahead)

    async def read() -> None:
        failure = None
        try:
            try:
                async for frame in frames:
                    await ahead.put(frame)
            finally:
                await frames.aclose()  # aclosing's work, without its objects held by every open stream
        except Exception as exc:  # noqa: BLE001 - handed over to the consumer, raised there
            failure = exc
        ahead.end(failure)

    reader = asyncio.create_task(read())
    try:
        while True:
            batch = await ahead.take()
            ended = ahead.ended and not ahead.frames
            if ended and last is not None:
                last()
            if batch:
                yield b"".join(batch)
            if ended:
                if ahead.failure is not None:
                    raise ahead.failure
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
