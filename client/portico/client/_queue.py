"""Bounded queues for non-urgent work: at most `max_size` requests waiting, at most `concurrency` running.

Submitting never blocks: a full queue raises QueueFull at once, so the caller decides (drop, defer, alert) instead
of piling up work or hammering the gateway. Urgent requests call the client directly and skip the queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from portico.client._errors import QueueFull

T = TypeVar("T")


@dataclass
class RequestQueue:
    """For the sync client: `submit(fn)` returns a concurrent.futures.Future run by one of `concurrency` threads."""

    max_size: int = 100
    concurrency: int = 2
    _waiting: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _executor: concurrent.futures.ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_size < 1 or self.concurrency < 1:
            raise ValueError("need max_size >= 1 and concurrency >= 1")
        self._executor = concurrent.futures.ThreadPoolExecutor(self.concurrency, "portico-queue")

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._waiting >= self.max_size:
                raise QueueFull(f"{self._waiting} requests already waiting (max_size {self.max_size})")
            self._waiting += 1
        try:
            future = self._executor.submit(self._run, fn)
        except BaseException:
            self._started()
            raise
        # A future cancelled while it waits never runs: its place is given back here (one that started cannot be
        # cancelled, so no place is given back twice).
        future.add_done_callback(lambda done: done.cancelled() and self._started())
        return future

    def close(self, *, wait: bool = True) -> None:
        """Stop accepting work; with wait, run what is queued first (else waiting requests are cancelled)."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> RequestQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, fn: Callable[[], T]) -> T:
        self._started()
        return fn()

    def _started(self) -> None:
        with self._lock:
            self._waiting -= 1


@dataclass
class AsyncRequestQueue:
    """For the asyncio client: `submit(factory)` returns a Future; `concurrency` tasks await `factory()` in order
    (cancelling the Future cancels that call, waiting or running).

    Create and use it inside one running event loop; `await close()` runs what is queued, then stops its tasks.
    """

    max_size: int = 100
    concurrency: int = 2
    _queue: asyncio.Queue | None = field(default=None, init=False, repr=False)
    _workers: list[asyncio.Task] = field(default_factory=list, init=False, repr=False)
    _waiting: int = field(default=0, init=False)  # counted here, not by the queue: a cancelled request leaves at once

    def __post_init__(self) -> None:
        if self.max_size < 1 or self.concurrency < 1:
            raise ValueError("need max_size >= 1 and concurrency >= 1")

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, factory: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        if self._waiting >= self.max_size:
            raise QueueFull(f"{self._waiting} requests already waiting (max_size {self.max_size})")
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((factory, future))
        self._waiting += 1
        future.add_done_callback(self._given_up)
        return future

    def _given_up(self, future: asyncio.Future) -> None:
        """A future cancelled while it waits: its place is free now (the worker that comes to it skips it)."""
        if future.cancelled():
            self._waiting -= 1

    async def close(self) -> None:
        if self._queue is not None:
            await self._queue.join()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers, self._queue = [], None

    async def __aenter__(self) -> AsyncRequestQueue:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _work(self) -> None:
        while True:
            factory, future = await self._queue.get()
            try:
                if not future.cancelled():  # else _given_up gave its place back
                    future.remove_done_callback(self._given_up)
                    self._waiting -= 1
                    await self._run(factory, future)
            finally:
                self._queue.task_done()

    @staticmethod
    async def _run(factory: Callable[[], Awaitable[T]], future: asyncio.Future[T]) -> None:
        """Await the call as a task of its own, cancelled with its future: a caller that gives up (wait_for, a
        cancelled task) ends the call too, so the gateway frees its slot and this worker moves on."""
        call = asyncio.ensure_future(_awaited(factory))
        future.add_done_callback(lambda _: call.cancel())  # nothing once the call is done
        try:
            await asyncio.wait((call,))
        except asyncio.CancelledError:  # the worker itself is stopped
            call.cancel()
            future.cancel()
            raise
        if future.done():
            return
        if call.cancelled():
            future.cancel()
        elif (error := call.exception()) is not None:
            future.set_exception(error)
        else:
            future.set_result(call.result())


async def _awaited(factory: Callable[[], Awaitable[T]]) -> T:
    """factory() inside the task, so that its errors, raised or awaited, reach the future."""
    return await factory()
