"""The ledger's batching writer against a real SQLite sink, and a sink that fails on cue."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from server.usage.ledger import LedgerRow
from server.usage.query import UsageQuery
from server.usage.settings import UsageSettings
from server.usage.sqlite_ledger import SqliteLedger
from server.usage.writer import LedgerWriter
from tests.limits_support import FakeClock


NOW_MS = int(time.time()) * 1000  # rows of today: a default retention pass must keep them


def row(n: int, **changes) -> LedgerRow:
    base = LedgerRow(id=f"r{n}", at_ms=NOW_MS + n, request_id=f"req-{n}", key_id="key_a", env="prod",
                     endpoint="/v1/chat/completions", model="m", upstream="m", status=200, code="",
                     input_tokens=10, output_tokens=5, cached_input_tokens=0, images=0, cost_micros=7,
                     upstream_attempts=1, latency_ms=12.5, first_token_ms=3.0)
    return replace(base, **changes)


class FlakySink:
    """SQLite underneath; fails while `down` is set."""

    def __init__(self, path) -> None:
        self.db = SqliteLedger(path)
        self.down = False
        self.calls = 0

    def write(self, rows) -> int:
        self.calls += 1
        if self.down:
            raise ConnectionError("store unreachable")
        return self.db.write(rows)

    def prune(self, before_ms: int, limit: int) -> int:
        return self.db.prune(before_ms, limit)


async def test_rows_are_written_in_batches_off_the_request_path(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=30, batch_rows=3, buffer_rows=10))
    writer.start()
    for n in range(2):
        writer.append(row(n))
    await asyncio.sleep(0.05)
    assert sink.rows() == []  # fewer than a batch and the flush interval not reached
    writer.append(row(2))  # a full batch wakes the writer
    for _ in range(100):
        if len(sink.rows()) == 3:
            break
        await asyncio.sleep(0.01)
    assert [r.id for r in sink.rows()] == ["r0", "r1", "r2"]
    writer.append(row(3))
    await writer.close()  # flushed on close
    assert len(sink.rows()) == 4


async def test_an_unreachable_store_keeps_rows_then_drops_past_the_buffer_counted_and_logged(tmp_path, caplog):
    sink = FlakySink(tmp_path / "l.db")
    dropped = []
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.02, batch_rows=2, buffer_rows=4),
                          on_dropped=dropped.append)
    sink.down = True
    writer.start()
    with caplog.at_level(logging.WARNING, logger="server.usage.writer"):
        for n in range(6):
            writer.append(row(n))
        for _ in range(200):
            if sink.calls >= 2:
                break
            await asyncio.sleep(0.01)
        assert sink.calls >= 2 and writer.pending == 4  # retried; four rows wait
        assert sum(dropped) == 2  # both counted; the first logged at once, the next within 10 s
        assert "dropped 1 row(s)" in caplog.text and "cannot write rows" in caplog.text
        sink.down = False
        for _ in range(200):
            if writer.pending == 0:
                break
            await asyncio.sleep(0.02)
    assert [r.id for r in sink.db.rows()] == ["r0", "r1", "r2", "r3"]
    assert "writing again" in caplog.text
    await writer.close()



async def test_a_short_outage_under_traffic_delays_the_rows_by_about_as_long_not_the_longest_pause(tmp_path):
    """Rows arriving while the store is down do not each retry the write at once: every failed retry doubled the
    pause, so a burst of requests during a brief outage took it to 30 s, and the rows were written ~30 s after the
    store was back."""
    sink = FlakySink(tmp_path / "l.db")
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.1, batch_rows=2, buffer_rows=1000))
    sink.down = True
    writer.start()
    for n in range(40):  # 0.2 s of traffic while the store is down
        writer.append(row(n))
        await asyncio.sleep(0.005)
    assert sink.calls <= 3  # retried at the growing pause only: 0.1 s, then 0.2 s
    sink.down = False
    deadline = time.monotonic() + 1.5  # the pause grew to 0.4 s at most
    while writer.pending:
        assert time.monotonic() < deadline, f"{writer.pending} rows still wait after the store came back"
        await asyncio.sleep(0.02)
    assert len(sink.db.rows()) == 40
    await writer.close()

async def test_rows_that_cannot_be_written_before_shutdown_are_counted(tmp_path, caplog):
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    dropped = []
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=10), on_dropped=dropped.append)
    writer.start()
    writer.append(row(1))
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        await writer.close(timeout=0.3)
    assert dropped == [1] and "before shutdown" in caplog.text


class SlowSink(FlakySink):
    """Each write takes 0.1 s, as a store under load may."""

    def write(self, rows) -> int:
        time.sleep(0.1)
        return super().write(rows)


async def test_rows_that_arrive_during_a_write_wait_for_the_next_batch(tmp_path):
    # Chasing them wrote a few rows per transaction, back to back, for as long as requests kept coming.
    sink = SlowSink(tmp_path / "l.db")
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=30, batch_rows=3, buffer_rows=10))
    writer.start()
    for n in range(3):
        writer.append(row(n))  # a full batch: written at once
    await asyncio.sleep(0.03)
    writer.append(row(3))  # arrives while that batch is being written
    await asyncio.sleep(0.3)
    assert sink.calls == 1 and [r.id for r in sink.db.rows()] == ["r0", "r1", "r2"] and writer.pending == 1
    await writer.close()
    assert sink.calls == 2 and len(sink.db.rows()) == 4


def test_a_batch_larger_than_one_insert_is_stored_whole(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    sink.write([row(n) for n in range(1201)])  # several multi-row statements, the last one partly filled
    sink.write([row(n) for n in range(1195, 1210)])  # overlaps: the stored ones are skipped
    assert [r.id for r in sink.rows()] == [f"r{n}" for n in range(1210)]


def test_batches_of_every_size_share_a_few_insert_statements(tmp_path):
    """A busy gateway's batches come in every size up to batch_rows. An INSERT of exactly each size made one SQL text
    and one prepared statement per size, each kept (functools.cache, sqlite3's statement cache): a process's RSS grew
    by ~100 MiB as sizes 1..500 turned up over a day. Batches are cut into power-of-two chunks: a handful of texts."""
    sink = SqliteLedger(tmp_path / "l.db")
    shapes: set[int] = set()  # rows per INSERT statement run (the callback sees the values filled in)
    sink._db.set_trace_callback(lambda sql: sql.startswith("INSERT") and shapes.add(sql.count("'req-")))
    start = 0
    for size in range(1, 301):
        sink.write([row(n) for n in range(start, start + size)])
        start += size
    assert len(sink.rows()) == start
    assert len(shapes) <= 10


def test_a_batch_written_twice_is_stored_once(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    sink.write([row(1), row(2)])
    sink.write([row(2), row(3)])  # a retry after a lost reply
    assert [r.id for r in sink.rows()] == ["r1", "r2", "r3"]


def test_retention_deletes_old_rows_at_most_a_batch_per_statement(tmp_path):
    """One DELETE of every row past retention held keys.db's write lock for its whole run (~3 s for 1.5 million
    rows): a key created meanwhile waited for it (a 503 past busy_timeout), and the key lookups queued behind that
    write on the key store's thread stalled admission as long."""
    sink = SqliteLedger(tmp_path / "l.db")
    sink.write([row(1), row(2), row(3), row(5)])
    assert sink.prune(NOW_MS + 4, 2) == 2
    assert sink.prune(NOW_MS + 4, 2) == 1
    assert [r.id for r in sink.rows()] == ["r5"]


class PruneRecordingSink:
    """SQLite underneath; records the order of its writes and deletes."""

    def __init__(self, path, on_first_prune) -> None:
        self.db = SqliteLedger(path)
        self.events: list[tuple[str, object]] = []
        self._on_first_prune = on_first_prune

    def write(self, rows) -> int:
        self.events.append(("write", [r.id for r in rows]))
        return self.db.write(rows)

    def prune(self, *args) -> int:
        if not any(kind == "prune" for kind, _ in self.events):
            self._on_first_prune()
        deleted = self.db.prune(*args)
        self.events.append(("prune", deleted))
        return deleted


async def test_a_retention_pass_over_a_big_backlog_does_not_hold_back_the_rows_written_meanwhile(tmp_path,
                                                                                                  monkeypatch):
    """A pass deleted every row past retention before the writer wrote another row: on 1.5 million rows in
    PostgreSQL no row was written for 23 s (the usage API missed every request of that time; at 1,900 req/s a
    bigger backlog would overflow usage.buffer_rows and drop rows). Now the pass deletes a batch per write pass."""
    monkeypatch.setattr("server.usage.writer.PRUNE_BATCH", 10)
    now = NOW_MS / 1000 + 10 * 86_400
    loop = asyncio.get_running_loop()
    sink = PruneRecordingSink(tmp_path / "l.db", lambda: loop.call_soon_threadsafe(writer.append, row(100, at_ms=int(
        now * 1000))))
    sink.db.write([row(n) for n in range(25)])  # 25 rows past retention
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.01, batch_rows=1, retention_days=5),
                          clock=lambda: now)
    writer.start()
    for _ in range(300):
        if [r.id for r in sink.db.rows()] == ["r100"]:
            break
        await asyncio.sleep(0.01)
    await writer.close()
    assert [r.id for r in sink.db.rows()] == ["r100"]
    deletes = [n for kind, n in sink.events if kind == "prune" and n]
    assert max(deletes) == 10 and sum(deletes) == 25
    written_at = sink.events.index(("write", ["r100"]))
    last_delete = max(i for i, (kind, n) in enumerate(sink.events) if kind == "prune" and n)
    assert written_at < last_delete  # written while the backlog was still being deleted


async def test_the_writer_applies_retention(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    now = NOW_MS / 1000 + 10 * 86_400
    sink.write([row(1), row(2, at_ms=int(now * 1000) - 1000)])
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.01, retention_days=5), clock=lambda: now)
    writer.start()
    await asyncio.sleep(0.1)
    await writer.close()
    assert [r.id for r in sink.rows()] == ["r2"]


async def test_a_wall_clock_stepped_back_does_not_hold_up_retention(tmp_path):
    """The hour between retention passes was timed on the wall clock: NTP stepping back a host that ran a day ahead
    held every pass off for that day and an hour, while rows past retention stayed (and a ledger grew)."""
    sink = SqliteLedger(tmp_path / "l.db")
    wall, steady = FakeClock(NOW_MS / 1000 + 10 * 86_400), FakeClock(1000.0)
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.01, retention_days=5), clock=wall, monotonic=steady)
    sink.write([row(1)])
    writer.start()
    for _ in range(100):  # the first pass, at start
        if not sink.rows():
            break
        await asyncio.sleep(0.01)
    wall.now -= 86_400  # the step back
    sink.write([row(2, at_ms=int((wall.now - 6 * 86_400) * 1000))])  # past retention by the clock as it is now
    wall.advance(3601)
    steady.advance(3601)  # an hour later
    for _ in range(100):
        if not sink.rows():
            break
        await asyncio.sleep(0.01)
    await writer.close()
    assert sink.rows() == []

def test_totals_per_bucket_and_group(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    t0 = 1_700_000_000_000
    sink.write([
        row(1, at_ms=t0), row(2, at_ms=t0 + 500, model="n", cost_micros=3),
        row(3, at_ms=t0 + 1500, key_id="key_b"), row(4, at_ms=t0 + 1600, upstream_attempts=0, input_tokens=0,
                                                      output_tokens=0, cost_micros=0, status=429),
    ])
    totals = sink.aggregate(UsageQuery(t0, t0 + 2000, 1000, group_by=("model",)))
    assert [(t.bucket, t.model, t.input_tokens, t.cost_micros, t.model_requests, t.rows) for t in totals] == [
        (0, "m", 10, 7, 1, 1), (0, "n", 10, 3, 1, 1), (1, "m", 10, 7, 1, 2),
    ]
    assert totals[0].key_id is None
    only_b = sink.aggregate(UsageQuery(t0, t0 + 2000, 1000, key_ids=("key_b",)))
    assert [(t.bucket, t.rows) for t in only_b] == [(1, 1)]


async def test_rows_dropped_after_the_first_warning_are_logged_without_a_later_drop(tmp_path, caplog, monkeypatch):
    """Drops are logged at most every few seconds; those that came after a warning were logged only if yet another
    row was dropped later, so an outage's last drops never reached the log (only the metric)."""
    monkeypatch.setattr("server.usage.writer._DROP_LOG_EVERY", 0.1)
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=0.02, batch_rows=1, buffer_rows=1))
    writer.start()
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        for n in range(4):
            writer.append(row(n))  # one waits; three dropped: the first logged at once, two within the interval
        for _ in range(100):
            if "dropped 2 row(s)" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "dropped 1 row(s)" in caplog.text and "dropped 2 row(s)" in caplog.text
    sink.down = False
    await writer.close()


async def test_a_row_the_store_refuses_is_dropped_alone_not_retried_forever(tmp_path, caplog):
    """A value beyond SQLite's 64-bit integers failed its whole batch on every retry: no later row was ever written.
    The rows around it are stored; it alone is counted and logged as dropped."""
    sink = SqliteLedger(tmp_path / "l.db")
    dropped: list[int] = []
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=30, batch_rows=100, buffer_rows=100),
                          on_dropped=dropped.append)
    for n in range(3):
        writer.append(row(n, cost_micros=2**70 if n == 1 else 7))
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        assert await writer.flush()
    assert [r.id for r in sink.rows()] == ["r0", "r2"]
    assert writer.pending == 0 and sum(dropped) == 1
    assert "refuses row r1 of key key_a" in caplog.text
    writer.append(row(3))
    assert await writer.flush()
    assert [r.id for r in sink.rows()] == ["r0", "r2", "r3"]
