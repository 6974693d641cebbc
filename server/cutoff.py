"""Ending the model calls a drain cannot wait for.

When a drain's `drain_seconds` run out, or a second stop signal ends it, grpc cancels the RPCs still running. A
cancelled RPC can send nothing more, so a caller whose stream had started would see it end as if it were complete:
no error event, no SDK exception, and an access-log line blaming the caller (499). So before grpc cancels anything,
the server cuts the model calls still running (`Cutoff.cut`): each call waiting on its provider is interrupted from
inside and fails with ServiceUnavailable, as if its provider had failed. From there the usual paths take over: the
dialect's error event after the first byte (server/services/streaming.py guard_stream), an error status before it,
the reservation settled with what was used, and the error's code in the access log and the usage ledger.

A call is interrupted by cancelling the task that waits on its provider, and only while it waits there, so the
cancellation lands inside the provider (which stops its work as for a caller who went away) and is turned into the
error right there. A call that is busy elsewhere when the cut comes (sending to a slow caller) fails at its next
wait instead.

A caller that goes away (a disconnect, a gRPC deadline) while a non-streamed answer (or images) is being generated
upstream does not end the exchange: the upstream goes on and bills the whole answer whatever its client does, so the
exchange runs on in the RPC's task, uncancelled (`Cutoff.outlast`, asked where the cancellation lands:
http_connection.Response, for HttpUpstream.post_json's `billed` exchanges), to be counted as any answer is. A drain
gives it the time it gives requests in flight (`ended`), then cuts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from server.errors import ServiceUnavailable

SHUTTING_DOWN = "The server is shutting down and could not finish this request in time. Please retry."

T = TypeVar("T")

ENDED_POLL_SECONDS = 0.05  # how often a drain looks whether the model calls whose caller left have ended


class Watch:
    """One model call's side of the cutoff."""

    __slots__ = ("cut", "waiting", "caller_left", "billed", "_loop", "_task", "_watches")

    def __init__(self, cut: bool, watches: set[Watch], billed: bool) -> None:
        self.cut = cut
        self.waiting = False  # the call is waiting on its provider now
        self.caller_left = False  # its caller went away, and the exchange runs on (Cutoff.outlast)
        self.billed = billed  # it may be priced: a caller who leaves does not end its upstream exchange
        self._watches = watches  # the cutoff's, which holds this watch while it is entered
        # Looked up once: current_task() without its loop looks the loop up each time (~0.2 µs on CPython 3.11).
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None  # the task that waits on the provider

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await the provider's `awaitable`; ServiceUnavailable if the call is cut before or meanwhile."""
        try:
            self.begin()
        except ServiceUnavailable:
            getattr(awaitable, "close", lambda: None)()  # never awaited: no "was never awaited" warning
            raise
        try:
            return await awaitable
        except asyncio.CancelledError:
            self.cancelled()
            raise
        finally:
            self.waiting = False

    # The same in steps, for a loop over a provider's events (metering.metered): `begin` before each wait, `waiting
    # = False` after it, `cancelled` when one was cancelled. No coroutine around each event, and the task is looked
    # up once per consumer (`handed_over`), not per event: each cost ~1,000 instructions an event.

    def begin(self) -> None:
        """Before waiting on the provider: ServiceUnavailable if the call was cut already."""
        if self.cut:
            raise ServiceUnavailable(SHUTTING_DOWN)
        if self._task is None:
            self._task = asyncio.current_task(self._loop)
        self.waiting = True

    def handed_over(self) -> None:
        """The events go to another consumer (perhaps another task) from now on."""
        self._task = None

    def cancelled(self) -> None:
        """A wait was cancelled: ServiceUnavailable if by the cut (the task goes on), else the caller's to raise
        (the caller went away, or grpc cancelled the RPC)."""
        self.waiting = False
        if self.cut and self._task is not None:
            self._task.uncancel()
            raise ServiceUnavailable(SHUTTING_DOWN) from None

    def __enter__(self) -> Watch:
        self._watches.add(self)
        return self

    def __exit__(self, *exc_info) -> None:
        self._watches.discard(self)

    def interrupt(self) -> None:
        self.cut = True
        if self.waiting and self._task is not None:
            self._task.cancel()


class Cutoff:
    """The model calls in flight, to be cut when the server stops."""

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._cut = False
        self._outlasting: set[asyncio.Task] = set()  # the tasks of calls whose caller left, running on

    def watch(self, *, billed: bool = False) -> Watch:
        """For the length of one model call (`with cutoff.watch() as watch`; a class, not a @contextmanager, which
        costs ~1 µs a request); a call that starts after the cut fails at its first wait. `billed`: its model, or a
        fallback that may answer instead, has a price, so a non-streamed exchange whose caller leaves runs on to be
        counted (`outlast`); one without (a self-hosted server, which stops generating when its client leaves) ends
        with its caller."""
        return Watch(self._cut, self._watches, billed)

    def cut(self) -> None:
        """Every call in flight, and any that starts later, fails with ServiceUnavailable."""
        self._cut = True
        for watch in list(self._watches):
            watch.interrupt()

    def outlast(self) -> bool:
        """Asked where a non-streamed upstream exchange that was sent is cancelled while it waits for its answer. If
        that is its caller going away (grpc cancels the RPC's task once), not the cut, the exchange runs on: the task
        is uncancelled and True returned. Only on this path: the requests whose caller stays pay nothing for it."""
        task = asyncio.current_task()
        if self._cut or task is None or task.cancelling() != 1:
            return False
        watch = next((w for w in self._watches if w._task is task and w.waiting), None)
        if watch is None or watch.caller_left or not watch.billed:  # not a model call (a token count), the
            return False  # caller's leaving already, or nothing billed to count
        task.uncancel()
        watch.caller_left = True
        self._outlasting.add(task)
        task.add_done_callback(self._outlasting.discard)
        return True

    def caller_left(self) -> bool:
        """The current task's call runs on after its caller left: no new attempt or fallback is started for it."""
        return asyncio.current_task() in self._outlasting

    async def ended(self) -> None:
        """Wait for every model call to end: a drain asks once grpc counts no call, so those still running are calls
        whose caller left, which run on (`outlast`) or are ending. Not only those already running on: a caller who
        leaves in the drain ends its call for grpc at once, perhaps before its task learns it. Polled: a drain is
        rare, and noting each call's end would cost every request."""
        while self._watches:
            await asyncio.sleep(ENDED_POLL_SECONDS)
