"""The ledger's spool: rows a process queued but did not write (it was killed) are written by the next writer to
start on the same directory, once each; a live process's rows are left to it."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.config_providers import ConfigError
from server.observability.record import Outcome, RequestRecord
from server.usage.settings import UsageSettings
from server.usage.spool import LedgerSpool
from server.usage.sqlite_ledger import SqliteLedger
from server.usage.writer import LedgerWriter
from tests.unit.test_ledger_writer import NOW_MS, FlakySink, row

SLOW = UsageSettings(flush_seconds=600)  # no pass of its own while a test runs


def mark(n: int) -> tuple:
    """A running request's mark (ledger.mark_of), as row(n) would be known at admission."""
    return (f"r{n}", NOW_MS + n, f"req-{n}", "key_a", "prod", "/v1/chat/completions", "m", "")


def killed(spool: LedgerSpool) -> None:
    """What `kill -9` leaves: the files as they are, their locks gone with the process's descriptors."""
    for segment in (*spool._sealed, spool._current):
        os.close(segment.fd)


async def test_rows_of_a_writer_that_died_are_written_by_the_next_one(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    first = LedgerWriter(sink, SLOW, spool=(spool := LedgerSpool(tmp_path / "spool")))
    first.start()
    for n in range(3):
        first.append(row(n))
    first._task.cancel()
    killed(spool)
    assert sink.rows() == []
    assert [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "spool").iterdir()] == ["0o600"]

    second = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    second.start()  # writes what it adopted at once, not after flush_seconds
    await second.flush()
    second.append(row(3))
    await second.close()
    assert sorted(r.id for r in sink.rows()) == ["r0", "r1", "r2", "r3"]
    assert row(1) in sink.rows()  # every value as it was
    assert list((tmp_path / "spool").iterdir()) == []  # written, so gone


async def test_a_live_writer_s_rows_are_not_taken(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    live = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    live.append(row(1))
    other = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    other.start()
    await other.close()
    assert sink.rows() == []
    await live.close()
    assert [r.id for r in sink.rows()] == ["r1"]


async def test_rows_the_store_refused_until_shutdown_stay_for_the_next_start(tmp_path, caplog):
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    dropped: list[int] = []
    first = LedgerWriter(sink, SLOW, on_dropped=dropped.append, spool=LedgerSpool(tmp_path / "spool"))
    first.start()
    first.append(row(1))
    first.append(row(2))
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        await first.close(timeout=0.3)
    assert dropped == [] and "stay in the spool" in caplog.text
    sink.down = False
    second = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    second.start()
    await second.close()
    assert sorted(r.id for r in sink.db.rows()) == ["r1", "r2"]


async def test_rows_neither_stored_nor_spooled_by_shutdown_are_counted_as_lost(tmp_path, caplog, monkeypatch):
    """A full disk fails keys.db's writes and the spool's alike. The rows that waited in memory only were lost at the
    stop, logged as staying in the spool, and not counted in portico_ledger_rows_dropped_total."""
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    dropped: list[int] = []
    first = LedgerWriter(sink, SLOW, on_dropped=dropped.append, spool=LedgerSpool(tmp_path / "spool"))
    first.start()
    first.append(row(1))  # in the spool
    real_append = LedgerSpool.append

    def disk_full(self, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LedgerSpool, "append", disk_full)
    first.append(row(2))  # in memory only
    first.append(row(3))
    monkeypatch.setattr(LedgerSpool, "append", real_append)
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        await first.close(timeout=0.3)
    assert dropped == [2]
    assert "1 row(s) could not be written before shutdown; they stay in the spool" in caplog.text
    assert "dropped 2 row(s)" in caplog.text
    sink.down = False
    second = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    second.start()
    await second.close()
    assert [r.id for r in sink.db.rows()] == ["r1"]


async def test_a_torn_line_is_skipped_and_logged(tmp_path, caplog):
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    spool.append(row(1))
    os.write(spool._current.fd, b'["r2", 17')  # the host died mid-write
    killed(spool)
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    with caplog.at_level(logging.ERROR, logger="server.usage.spool"):
        writer.start()
    await writer.close()
    assert [r.id for r in sink.rows()] == ["r1"]
    assert "1 unreadable line(s)" in caplog.text


async def test_a_request_running_when_its_writer_died_gets_its_mark_s_row(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    first = LedgerWriter(sink, SLOW, spool=spool)
    finished = spool.mark(mark(1))
    spool.mark(mark(2))
    await first.flush()  # seals the segment with both marks: kept while one of them runs
    first.append(row(1))
    spool.ended(finished)
    await first.flush()
    assert [r.id for r in sink.rows()] == ["r1"]
    assert len(list((tmp_path / "spool").iterdir())) == 2  # the marks' segment, and the one being appended to
    killed(spool)

    written: list[int] = []
    second = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"), on_written=written.append)
    second.start()
    await second.close()
    assert sum(written) == 1  # portico_ledger_rows_written_total: r2; r1 was stored before
    assert {r.id: (r.status, r.code, r.upstream, r.upstream_attempts, r.cost_micros) for r in sink.rows()} == {
        "r1": (200, "", "m", 1, 7),  # its real row, written before: the mark of the same id stored nothing more
        "r2": (503, "service_unavailable", "m", 1, 0)}
    assert list((tmp_path / "spool").iterdir()) == []


async def test_what_a_dead_request_s_reservation_booked_is_handed_back_for_settling(tmp_path):
    """Only for a request that never ended (its row says nothing used): one that ended settled its own. A mark of a
    version before reservations were in marks has none to hand back."""
    spool = LedgerSpool(tmp_path / "spool")
    spool.mark(mark(1), ["res-1", 1.5, ["key_a"], 90, 4])
    spool.mark(mark(2), ["res-2", 2.5, ["key_a"], 80, 3])
    spool.mark(mark(3))
    spool.append(row(1))
    killed(spool)
    writer = LedgerWriter(SqliteLedger(tmp_path / "l.db"), SLOW, spool=LedgerSpool(tmp_path / "spool"))
    assert [booked for booked, _ in writer.start()] == [["res-2", 2.5, ["key_a"], 80, 3]]
    await writer.close()


async def test_a_reservation_booked_in_the_mark_by_a_version_of_27_november_is_handed_back(tmp_path):
    """Versions from d3188ee until 7fb2452 (27 November 2026, f9a2dbf among them) wrote what a reservation booked as
    a mark's ninth value: upgraded from one killed with requests running, the new version wrote their 503 rows but
    settled none, so with Redis each one's concurrency slot stayed taken until its lease ended (a key at its limit
    refused meanwhile) and its estimates stayed in the day's tokens and spend."""
    directory = tmp_path / "spool"
    directory.mkdir()
    booked = ["res-1", 1.5, ["key_a"], 80, 3]
    (directory / "123-1.rows").write_text(json.dumps({"open": [*mark(1), booked]}) + "\n"  # as f9a2dbf wrote it
                                          + json.dumps({"open": [*mark(2), None]}) + "\n")  # its in-process store
    sink = SqliteLedger(tmp_path / "l.db")
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(directory))
    assert [value for value, _ in writer.start()] == [booked]
    await writer.close()
    assert sorted((r.id, r.status) for r in sink.rows()) == [("r1", 503), ("r2", 503)]


async def test_a_dead_request_s_segment_is_kept_until_its_reservation_is_settled(tmp_path):
    """Deleted once its rows were written, a segment took with it what a reservation not settled yet (Redis not
    answering) had booked: the adopter stopped meanwhile, and no process could settle it."""
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    spool.mark(mark(1), ["res-1", 1.5, ["key_a"], 80, 3])
    killed(spool)
    adopter = LedgerWriter(sink, SLOW, spool=(adopting := LedgerSpool(tmp_path / "spool")))
    [(_, settled)] = adopter.start()
    await adopter.flush()
    assert [r.id for r in sink.rows()] == ["r1"]
    killed(adopting)  # before Redis took the settlement
    again = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    [(booked, settled)] = again.start()
    assert booked == ["res-1", 1.5, ["key_a"], 80, 3]
    settled()
    await again.close()
    assert [r.id for r in sink.rows()] == ["r1"]  # stored once
    assert list((tmp_path / "spool").iterdir()) == []


def test_marks_stay_readable_by_the_released_version_an_operator_may_downgrade_to(tmp_path):
    """Versions up to f39270b read a mark as exactly eight values (`row_id, ..., deployment = line["open"]`): a mark
    with its reservation as a ninth was an unreadable line to them, so after a downgrade a request running at a kill
    got no row, and every mark, of finished requests too, was logged as an error. The reservation goes beside."""
    spool = LedgerSpool(tmp_path / "spool")
    spool.mark(mark(1), ["res-1", 1.5, ["key_a"], 80, 3])
    spool.mark(mark(2))  # an in-process limit store books nothing
    killed(spool)
    [path] = (tmp_path / "spool").iterdir()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        row_id, at_ms, request_id, key_id, env, endpoint, model, deployment = line["open"]  # as f39270b reads it
    assert [line.get("booked") for line in lines] == [["res-1", 1.5, ["key_a"], 80, 3], None]


async def test_a_mark_and_its_row_in_one_spool_make_one_row(tmp_path):
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    spool.mark(mark(1))
    spool.seal()
    spool.append(row(1))  # ended in a later segment, never written: the row wins over the mark
    killed(spool)
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    writer.start()
    await writer.close()
    assert [(r.id, r.status) for r in sink.rows()] == [("r1", 200)]


async def test_a_spool_directory_deleted_under_the_writer_is_made_again(tmp_path, caplog):
    """An operator's `rm -rf <data_dir>/ledger-spool` (or a cleanup job) killed the writer's task at its next pass:
    no row was written again, and the stop ended in a traceback. Now the next segment recreates the directory."""
    sink = SqliteLedger(tmp_path / "l.db")
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    writer.start()
    writer.append(row(1))
    for path in (tmp_path / "spool").iterdir():
        path.unlink()
    (tmp_path / "spool").rmdir()
    writer.append(row(2))
    assert await writer.flush()
    assert sorted(r.id for r in sink.rows()) == ["r1", "r2"]
    writer.append(row(3))  # spooled again, in the directory made anew
    assert [p.suffix for p in (tmp_path / "spool").iterdir()] == [".rows"]
    await writer.close()
    assert sorted(r.id for r in sink.rows()) == ["r1", "r2", "r3"]


async def test_a_segment_that_cannot_be_started_keeps_the_writer_going(tmp_path, monkeypatch, caplog):
    """No descriptor left (EMFILE) or no inode: the rows are written all the same, and the spool keeps its current
    segment (its rows, written twice at worst, are stored once each by their ids)."""
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    writer = LedgerWriter(sink, SLOW, spool=spool)
    writer.start()
    writer.append(row(1))

    def no_descriptor():
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(spool, "_new_segment", no_descriptor)
    with caplog.at_level(logging.ERROR, logger="server.usage.writer"):
        assert await writer.flush()
    assert [r.id for r in sink.rows()] == ["r1"]
    assert "Too many open files" in caplog.text
    monkeypatch.undo()
    writer.append(row(2))
    await writer.close()
    assert sorted(r.id for r in sink.rows()) == ["r1", "r2"]
    assert list((tmp_path / "spool").iterdir()) == []


_TORN = """
import os, resource, signal, sys
from pathlib import Path
from server.usage.spool import LedgerSpool
from tests.unit.test_ledger_writer import row

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG), as on a full disk
spool = LedgerSpool(Path(sys.argv[1]))
spool.append(row(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (os.fstat(spool._current.fd).st_size + 20, resource.RLIM_INFINITY))
try:
    spool.append(row(2))  # 20 bytes of it fit: a short write
except OSError:
    pass
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
spool.append(row(3))
os._exit(0)  # killed: the segment stays
"""


async def test_a_row_cut_short_by_a_full_disk_does_not_take_the_next_one_with_it(tmp_path, caplog):
    """A short write left a fragment of a row; the next row was glued to it, so a process killed then lost both."""
    subprocess.run([sys.executable, "-c", _TORN, str(tmp_path / "spool")], check=True, capture_output=True,
                   cwd=Path(__file__).parents[2])
    sink = SqliteLedger(tmp_path / "l.db")
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    with caplog.at_level(logging.ERROR, logger="server.usage.spool"):
        writer.start()
    await writer.close()
    assert sorted(r.id for r in sink.rows()) == ["r1", "r3"]  # r2 waited in memory only, as logged
    assert "1 unreadable line(s)" in caplog.text


def test_a_spool_path_taken_by_a_file_is_one_line_at_start(tmp_path):
    """A file where `ledger-spool/` should be stopped `portico serve` with a FileExistsError traceback."""
    (tmp_path / "ledger-spool").write_bytes(b"")
    with pytest.raises(ConfigError,
                       match=r"data_dir: cannot create .*ledger-spool \(a file is there, not a directory\)"):
        LedgerSpool(tmp_path / "ledger-spool")


async def test_a_store_outage_does_not_add_a_segment_per_retry(tmp_path):
    """Each failed pass started a segment (a file and a descriptor held until the store came back): a night-long
    outage with traffic, one retry every 30 s, ran the process out of descriptors."""
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    spool = LedgerSpool(tmp_path / "spool")
    writer = LedgerWriter(sink, SLOW, spool=spool)
    for n in range(20):
        writer.append(row(n))
        assert not await writer.flush()
    assert len(list((tmp_path / "spool").iterdir())) <= 2
    assert len(spool._sealed) <= 1
    sink.down = False
    assert await writer.flush()
    await writer.close()
    assert sorted(r.id for r in sink.db.rows()) == sorted(f"r{n}" for n in range(20))
    assert list((tmp_path / "spool").iterdir()) == []


async def test_a_segment_being_started_is_never_adopted(tmp_path, monkeypatch):
    """A segment's file was made, then locked: a process starting in between (the worker replacing a killed one)
    took it for a dead process's, and deleted it with the owner's rows still to come (or made the owner's lock
    fail)."""
    sink = SqliteLedger(tmp_path / "l.db")
    spool = LedgerSpool(tmp_path / "spool")
    spool.append(row(1))
    lock = fcntl.flock
    adopter: list[LedgerSpool] = []

    def adopting_first(fd: int, operation: int) -> None:
        monkeypatch.setattr(fcntl, "flock", lock)
        # Another process starts just as this one's new segment is made.
        adopter.append(LedgerSpool(tmp_path / "spool"))
        adopter[0].adopt()
        adopter[0].release()
        lock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", adopting_first)
    spool.seal()
    spool.append(row(2))
    killed(spool)
    killed(adopter[0])
    writer = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    writer.start()
    await writer.close()
    assert sorted(r.id for r in sink.rows()) == ["r1", "r2"]


async def test_rows_written_for_a_dead_process_do_not_crowd_out_this_one_s(tmp_path):
    """The rows adopted from a killed process's spool counted against this process's buffer: after workers killed in
    a store outage, the one replacing them dropped every row of its own until the adopted ones were written."""
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    settings = UsageSettings(flush_seconds=600, batch_rows=2, buffer_rows=2)
    dead = LedgerSpool(tmp_path / "spool")
    first = LedgerWriter(sink, settings, spool=dead)
    first.append(row(1))
    first.append(row(2))
    killed(dead)
    dropped: list[int] = []
    second = LedgerWriter(sink, settings, spool=LedgerSpool(tmp_path / "spool"), on_dropped=dropped.append)
    second.start()
    second.append(row(3))
    second.append(row(4))
    assert dropped == []
    sink.down = False
    await second.close()
    assert sorted(r.id for r in sink.db.rows()) == ["r1", "r2", "r3", "r4"]


async def test_a_request_whose_row_was_dropped_gets_no_503_row_at_the_next_start(tmp_path):
    """A request answered while the buffer was full lost its row (dropped: counted, logged), but its mark stayed in
    the spool: stopped before the store came back, the next start wrote it a 503 with nothing used, a failure that
    never happened."""
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=600, batch_rows=2, buffer_rows=2),
                          spool=LedgerSpool(tmp_path / "spool"))
    records = [RequestRecord(rpc="m", endpoint="/v1/chat/completions", request_id=f"req-{n}", started=0.0,
                             arrived=NOW_MS / 1000, key_id="key_a", key_env="prod", model="m") for n in range(3)]
    for record in records:
        writer.opened(record)
    for record in records:
        record.upstream_attempts = 1
        writer.add(record, Outcome(200), 1.0)  # the third is dropped: the buffer holds two
    await writer.close(timeout=0)
    sink.down = False
    second = LedgerWriter(sink, SLOW, spool=LedgerSpool(tmp_path / "spool"))
    second.start()
    await second.close()
    assert sorted((r.request_id, r.status) for r in sink.db.rows()) == [("req-0", 200), ("req-1", 200)]


async def test_the_spool_stops_growing_once_the_buffer_is_full(tmp_path):
    """Rows past the buffer are dropped, but each request still left a mark (and then a note that its row was
    dropped) in the spool: a long outage filled the disk, ~190 bytes a request, all read back into memory at the
    next start."""
    sink = FlakySink(tmp_path / "l.db")
    sink.down = True
    writer = LedgerWriter(sink, UsageSettings(flush_seconds=600, batch_rows=2, buffer_rows=2),
                          spool=LedgerSpool(tmp_path / "spool"))

    def request(n: int) -> None:
        record = RequestRecord(rpc="m", endpoint="/v1/chat/completions", request_id=f"req-{n}", arrived=NOW_MS / 1000,
                               key_id="key_a", key_env="prod", model="m", upstream_attempts=1)
        writer.opened(record)
        writer.add(record, Outcome(200), 1.0)

    def spooled() -> int:
        return sum(p.stat().st_size for p in (tmp_path / "spool").iterdir())

    request(0)
    request(1)
    full = spooled()
    for n in range(2, 50):
        request(n)
    assert spooled() == full
    sink.down = False
    await writer.close()
    assert sorted(r.request_id for r in sink.db.rows()) == ["req-0", "req-1"]
