"""The ledger's writer: rows are queued by the request that ends (a deque append and a line to the spool) and
written in batches by one background task, every `flush_seconds` or as soon as `batch_rows` are waiting, in a
thread so the event loop never waits for the database.

When the store cannot be written, rows stay queued (up to `buffer_rows`) and the batch is retried with a growing
pause (rows arriving meanwhile do not hurry it); rows that arrive while the buffer is full are dropped, counted in
`portico_ledger_rows_dropped_total` and logged (never silently). Each queued row is also appended to the spool
(server/usage/spool.py) until the store has it, so a process killed before its next batch loses none: the next
process to start on the data dir writes them. A row may be written twice (a write that succeeded but whose reply
was lost is retried): rows carry unique ids and sinks insert them once. `close` (at the end of a drain) writes what
is queued, retrying until its deadline; what still cannot be written stays in the spool for the next start
(rows the spool could not take, or all without a spool: counted and logged as dropped). A batch the store refuses for
its values (RowsRefused) is written row by row, and only the rows refused alone are dropped (counted and logged):
retried, they would hold up every row behind them for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Protocol, TypeVar

from server.limits.core import ReservationIds
from server.observability.record import Outcome, RequestRecord
from server.usage.ledger import LedgerRow, RowsRefused, mark_of, row_of
from server.usage.settings import UsageSettings
from server.usage.spool import Adopted, LedgerSpool, Segment

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_MAX_BACKOFF = 30.0  # seconds between retries while the store stays unreachable
_PRUNE_EVERY = 3600.0  # seconds between retention passes
# Rows a retention pass deletes per write pass (one statement: ~25 ms in SQLite, ~100 ms in PostgreSQL).
PRUNE_BATCH = 10_000
_DROP_LOG_EVERY = 10.0  # seconds between warnings while rows are being dropped


class LedgerSink(Protocol):
    """Where rows go. Called from a worker thread, one call at a time."""

    def write(self, rows: Sequence[LedgerRow]) -> int:
        """Store the rows in one transaction, each id once (rows already stored are skipped); how many it stored.
        Raise on failure."""
        ...

    def prune(self, before_ms: int, limit: int) -> int:
        """Delete up to `limit` of the rows that arrived before `before_ms`, in one short statement; returns how
        many."""
        ...


class LedgerWriter:
    def __init__(self, sink: LedgerSink, settings: UsageSettings, *,
                 on_dropped: Callable[[int], None] = lambda n: None,
                 on_written: Callable[[int], None] = lambda n: None,
                 clock: Callable[[], float] = time.time, spool: LedgerSpool | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._sink = sink
        # Its calls wait out the store (a statement timeout, a read holding the ledger's connection up to 60 s): in a
        # thread of its own, never one of asyncio's default few, which also count prompts and store images.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ledger-writer")
        self._spool = spool
        self._spool_failing = False  # the spool cannot be written (disk full...): logged once when it starts
        self._seal_failing = False  # no new spool segment can be made (inodes out): logged once when it starts
        self._unspooled: set[str] = set()  # ids of queued rows the spool could not take: lost if not stored by the end
        self._marked: dict[str, Segment] = {}  # row id -> the segment holding the mark of a request still running
        self._settings = settings
        self._on_dropped = on_dropped
        self._on_written = on_written
        self._clock = clock  # the retention cut-off: rows hold wall-clock times
        self._monotonic = monotonic  # the hour between retention passes, which a clock stepped back must not stretch
        self._queue: deque[LedgerRow] = deque()
        self._in_flight = 0  # rows at the queue's left that the batch being written holds
        self._adopted = 0  # rows at the queue's left from dead processes' spools: not held against buffer_rows
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()  # the background task and an explicit flush never take the same rows
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._failing = False  # the store is failing: logged once when it starts and once when it ends
        self._dropped_unlogged = 0
        self._drop_why = ""
        self._drop_logged_at = -_DROP_LOG_EVERY
        self._pruned_at = -_PRUNE_EVERY  # when the last retention pass began (monotonic, never negative)
        self._prune_before: int | None = None  # the retention pass under way deletes the rows before this
        self._pruned = 0  # rows it deleted so far
        self._ids = ReservationIds()  # row ids: unique across processes, like reservation ids

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> list[tuple[object, Callable[[], None]]]:
        """Start writing, first the rows a dead process left in the spool. Returns what the rate-limit reservations
        of its requests that never ended booked (Limiter.booked), for the limiter to settle, each with what to call
        once it is settled (Adopted)."""
        adopted = self._spool.adopt() if self._spool is not None else Adopted([], [])
        if adopted.rows:
            _logger.warning("usage ledger: %d row(s) left in the spool by a process that ended (killed, or stopped "
                            "while the store could not be written) are written now, each stored once",
                            len(adopted.rows))
            self._queue.extend(adopted.rows)
            self._adopted = len(adopted.rows)
            self._wake.set()
        self._task = asyncio.create_task(self._run(), name="ledger-writer")
        return adopted.reservations

    # RequestSink (server/observability/telemetry.py)
    def opened(self, record: RequestRecord) -> None:
        if self._spool is None or self._full():  # its row would be dropped: a mark per request grew the spool for good
            return
        record.ledger_id = self._ids.new()
        if (segment := self._to_spool(self._spool.mark, mark_of(record), record.booked)) is not None:
            self._marked[record.ledger_id] = segment

    def add(self, record: RequestRecord, outcome: Outcome, finished: float) -> None:
        queued = self.append(row_of(record, outcome, finished, self._ids))
        if (segment := self._marked.pop(record.ledger_id, None)) is not None:
            if not queued:  # else its mark, left in the spool by a stop before the store came back, made it a 503
                self._to_spool(LedgerSpool.dropped, segment, record.ledger_id)
            LedgerSpool.ended(segment)

    def append(self, row: LedgerRow) -> bool:
        """Queue the row; False if it was dropped (the buffer is full)."""
        if self._full():
            self._drop(1, "the ledger's buffer is full (the store has not accepted rows for a while)")
            return False
        if self._spool is not None:
            self._to_spool(self._spool.append, row)  # failing, the row waits in memory only
            if self._spool_failing:
                self._unspooled.add(row.id)
        self._queue.append(row)
        # A full batch is written at once, but not while the store fails: each row would retry the write then, and
        # each failed retry doubles the pause, so a burst in a brief outage left the rows waiting 30 s after it.
        if not self._failing and len(self._queue) - self._in_flight >= self._settings.batch_rows:
            self._wake.set()
        return True

    def _full(self) -> bool:
        return len(self._queue) - self._adopted >= self._settings.buffer_rows

    def _to_spool(self, write: Callable[..., _T], *args: object) -> _T | None:
        """A write to the spool; one that fails (a full disk, no descriptor left) is None, logged once until a write
        works again: the rows wait in memory meanwhile, lost only if the process dies before they are stored."""
        try:
            result = write(*args)
        except OSError as exc:
            if not self._spool_failing:
                _logger.error("usage ledger: cannot write the spool (%s); rows wait in memory only", exc)
                self._spool_failing = True
            return None
        if self._spool_failing:
            _logger.warning("usage ledger: writing the spool again")
            self._spool_failing = False
        return result

    async def _run(self) -> None:
        pause = self._settings.flush_seconds
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                # Wake in time to log drops held back by the log's interval, also when no further row comes.
                await asyncio.wait_for(self._wake.wait(), min(pause, _DROP_LOG_EVERY) if self._dropped_unlogged
                                       else pause)
            self._wake.clear()
            if self._stopping:
                break
            pause = self._settings.flush_seconds if await self._write_all() else min(pause * 2, _MAX_BACKOFF)
            self._log_drops()
            if not self._failing:
                await self._prune()

    async def _write_all(self) -> bool:
        """Write the rows queued now, in batches; False if the store failed. Rows that arrive meanwhile wait for the
        next pass: chasing them until the queue was empty wrote a few rows per transaction back to back under load
        (a thread hop and a commit every ~2 ms, ~7 % of a core at 1,900 req/s, against ~1 % in 500-row batches)."""
        async with self._writing:
            left = len(self._queue)
            # Not while the store fails: each retry would start a segment, a file and a descriptor held until it
            # came back. The rows queued since stay in the current one, released by the pass after the store's return.
            if self._spool is not None and not self._failing:
                # The rows queued now are the sealed segments' (and adopted ones'). Failing, the current segment
                # keeps them: a next start may write them again, once each.
                self._seal()
            while left > 0:
                count = min(left, self._settings.batch_rows)
                if not await self._write_batch(count):
                    return False
                left -= count
            if self._spool is not None:
                self._spool.release()
            return True

    def _seal(self) -> None:
        """A new spool segment for the rows from now on. One that cannot be made (no inode left, a full disk) leaves
        them in the current one, still spooled: logged once until one is made, apart from the spool failing, whose
        next append, working, said it wrote again: two error lines a second for as long as the inodes were out."""
        assert self._spool is not None
        try:
            sealed = self._spool.seal()
        except OSError as exc:
            if not self._seal_failing:
                _logger.error("usage ledger: cannot start a new spool file (%s); rows go on into the current one", exc)
                self._seal_failing = True
            return
        if sealed and self._seal_failing:
            _logger.warning("usage ledger: starting new spool files again")
            self._seal_failing = False

    async def _write_batch(self, count: int) -> bool:
        batch = list(islice(self._queue, count))
        self._in_flight = count
        try:
            stored, refused = await asyncio.get_running_loop().run_in_executor(self._thread, self._write, batch)
        except Exception as exc:  # noqa: BLE001 - whatever the driver raises, the rows wait and are retried
            if not self._failing:
                _logger.error("usage ledger: cannot write rows (%s: %s); %d rows wait and are retried",
                              type(exc).__name__, exc, len(self._queue))
                self._failing = True
            return False
        finally:
            self._in_flight = 0
        for _ in batch:  # only this task takes rows off the left; new ones are appended on the right meanwhile
            self._queue.popleft()
        if self._unspooled:
            self._unspooled.difference_update(row.id for row in batch)
        self._adopted = max(0, self._adopted - len(batch))
        for row, why in refused:
            _logger.error("usage ledger: the store refuses row %s of key %s (%s)", row.id, row.key_id, why)
            self._drop(1, "the store refuses the row's values")
        self._on_written(stored)
        if self._failing:
            _logger.warning("usage ledger: writing again")
            self._failing = False
        return True

    def _write(self, batch: list[LedgerRow]) -> tuple[int, list[tuple[LedgerRow, RowsRefused]]]:
        """In a worker thread: the batch in one write; if the store refuses its values, each row on its own, so that
        only the rows it refuses alone are left out (returned, with how many rows were stored: rows already stored,
        written again by a retry or from a dead process's spool, are not). Any other failure is raised: the batch is
        retried, its rows stored once each by their ids."""
        try:
            return self._sink.write(batch), []
        except RowsRefused:
            pass
        stored, refused = 0, []
        for row in batch:
            try:
                stored += self._sink.write([row])
            except RowsRefused as exc:
                refused.append((row, exc))
        return stored, refused

    async def _prune(self) -> None:
        """A batch of the retention pass per write pass: a big backlog (retention lowered, an old ledger) is deleted
        over many passes with the rows that arrive meanwhile written between them. Deleted at once, 1.5 million rows
        held the writer 23 s (PostgreSQL) and keys.db's write lock 3 s (SQLite)."""
        days = self._settings.retention_days
        if not days:
            return
        if self._prune_before is None:
            # Timed on the monotonic clock: on the wall clock, one stepped back by a day (NTP mending a host that ran
            # ahead) deleted nothing for that day and the hour after it.
            tick = self._monotonic()
            if tick - self._pruned_at < _PRUNE_EVERY:
                return
            self._pruned_at = tick
            self._prune_before, self._pruned = int((self._clock() - days * 86_400) * 1000), 0
        try:
            deleted = await asyncio.get_running_loop().run_in_executor(self._thread, self._sink.prune,
                                                                     self._prune_before, PRUNE_BATCH)
        except Exception as exc:  # noqa: BLE001 - the next pass, within the hour, deletes what is left
            _logger.warning("usage ledger: retention pass failed (%s: %s)", type(exc).__name__, exc)
            self._prune_before = None
            return
        self._pruned += deleted
        if deleted < PRUNE_BATCH:
            if self._pruned:
                _logger.info("usage ledger: deleted %d rows older than %d days", self._pruned, days)
            self._prune_before = None

    def _drop(self, count: int, why: str) -> None:
        self._on_dropped(count)
        self._dropped_unlogged += count
        self._drop_why = why
        self._log_drops()

    def _log_drops(self) -> None:
        """Log the drops not logged yet, at most every _DROP_LOG_EVERY seconds: the writer's passes log those that
        came after the last warning, so each lost row reaches the log, not only the metric."""
        now = time.monotonic()
        if self._dropped_unlogged and now - self._drop_logged_at >= _DROP_LOG_EVERY:
            _logger.error("usage ledger: dropped %d row(s): %s", self._dropped_unlogged, self._drop_why)
            self._dropped_unlogged, self._drop_logged_at = 0, now

    async def flush(self) -> bool:
        """Write everything queued now (tests, and close); False if the store failed."""
        return await self._write_all()

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the background task, then write what is queued, retrying until `timeout`."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        deadline = time.monotonic() + timeout
        while not await self._write_all() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        # Without a spool, or where it could not take them (a full disk fails it and keys.db alike), rows are lost.
        lost = len(self._queue) if self._spool is None else sum(row.id in self._unspooled for row in self._queue)
        if kept := len(self._queue) - lost:
            _logger.error("usage ledger: %d row(s) could not be written before shutdown; they stay in the spool, "
                          "written by the next process to start on this data dir", kept)
        if lost:
            self._queue = deque()
            self._drop_logged_at = -_DROP_LOG_EVERY
            self._drop(lost, "the store could not be written before shutdown"
                       + (", nor the spool" if self._spool is not None else ""))
        if self._spool is not None:
            self._spool.close()
        self._thread.shutdown(wait=False)
