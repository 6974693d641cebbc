"""The ledger's spool: each row is appended to a file in `<data_dir>/ledger-spool/` as it is queued, so that a
process killed before its writer's next batch (`kill -9`, out of memory) loses no row of a request it answered:
the next process to start on the data dir (the worker that replaces it, or `portico serve` started again) adopts
the dead process's files and writes their rows. A request handed to its model also leaves a mark, from which the
next process writes its row (ledger.died), and has its rate-limit reservation settled as the row says, if its
process died before it ended.

A process holds an exclusive flock on each segment file it has: the lock dies with the process, so a segment whose
lock can be taken has no live owner. A write pass seals the segment being appended to and starts a new one; once
every row queued before the seal is in the store, the sealed segments are deleted, but for those holding marks of
requests still running (or, adopted, of a dead process's requests whose reservations are not settled yet).
Adopted, a mark counts only where no row has its id: a row already in the store keeps it (sinks store each id once);
a mark followed by `{"dropped": id}` counts nowhere (its row was dropped, logged). One row is one line (its values
in COLUMNS order, as JSON; a mark's inside `{"open": ...}`, with its reservation in `"booked"`); a line that does
not parse (the host, not the process, died mid-write) is skipped, logged. Lines are in the page cache once written:
a dying process loses none, a dying host may.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from server.config_providers import ConfigError
from server.private_files import make_data_dir
from server.usage.ledger import LedgerRow, died, values_of

_logger = logging.getLogger(__name__)

_SUFFIX = ".rows"


@dataclass(frozen=True, slots=True)
class Adopted:
    """What `adopt` found: rows to write, and the reservations (Limiter.booked) of requests still running when their
    process died, for the limiter to settle as their rows say: one request, nothing used. Each comes with what to call
    once the store took it: until then its segment is kept, so that the next process settles it if this one stops
    first (a drain or a kill while Redis does not answer)."""

    rows: list[LedgerRow]
    reservations: list[tuple[object, Callable[[], None]]]


@dataclass(slots=True)
class Segment:
    path: Path
    fd: int  # open, and locked by this process
    lines: int = 0  # rows and marks
    running: int = 0  # marks of requests still running: kept for them until they end
    torn: bool = False  # a full disk took part of a line: the next one starts on a line of its own


class LedgerSpool:
    def __init__(self, directory: Path) -> None:
        make_data_dir(directory)
        self._directory = directory
        self._sealed: list[Segment] = []
        try:
            self._current = self._new_segment()
        except OSError as exc:  # no inode left, a read-only data dir: one line at start, not a traceback
            raise ConfigError(f"data_dir: cannot create a file in {directory} ({exc.strerror or exc})") from None

    def _new_segment(self) -> Segment:
        self._directory.mkdir(mode=0o700, exist_ok=True)  # deleted under a running process: made again
        path = self._directory / f"{os.getpid()}-{time.time_ns()}{_SUFFIX}"
        # Made under a name `adopt` passes over, and named once locked: a process starting between the two would
        # take it for a dead process's, and delete it.
        making = path.with_suffix(".new")
        fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, path)
        return Segment(path, fd)

    def append(self, row: LedgerRow) -> None:
        """One write of one line: a process killed after it returns has the row on disk. Raises OSError, also when
        only part of the line could be written."""
        _write(self._current, orjson.dumps(values_of(row), option=orjson.OPT_APPEND_NEWLINE))

    def mark(self, mark: tuple, booked: object = None) -> Segment:
        """A request handed to its model (ledger.mark_of), with what its rate-limit reservation booked (None: nothing
        to settle): the next process to start writes its `died` row, and settles the reservation, if this one dies
        before the request ends. `ended(segment)` when it ends. Raises OSError as `append`."""
        segment = self._current
        line = {"open": mark} if booked is None else {"open": mark, "booked": booked}  # older versions read "open" only
        _write(segment, orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        segment.running += 1
        return segment

    @staticmethod
    def ended(segment: Segment) -> None:
        segment.running -= 1

    @staticmethod
    def dropped(segment: Segment, row_id: str) -> None:
        """The row of a request marked in `segment` was dropped (the buffer was full): its mark makes no row. Said
        in the mark's own segment, which outlives neither. Raises OSError as `append`."""
        _write(segment, orjson.dumps({"dropped": row_id}, option=orjson.OPT_APPEND_NEWLINE))

    def seal(self) -> bool:
        """Rows appended from now on go to a new segment; the ones before wait in sealed segments for `release`.
        False when the current one holds nothing (nothing to seal). Raises OSError when no segment can be started:
        the current one then goes on taking rows."""
        if not self._current.lines:
            return False
        segment = self._new_segment()
        self._sealed.append(self._current)
        self._current = segment
        return True

    def release(self) -> None:
        """Every row of the sealed segments is in the store (or was refused by it, logged): they go, but for those
        with marks of requests still running."""
        kept = []
        for segment in self._sealed:
            if segment.running:
                kept.append(segment)
            else:
                segment.path.unlink(missing_ok=True)
                os.close(segment.fd)
        self._sealed = kept

    def adopt(self) -> Adopted:
        """The rows of the segments no live process holds, oldest first, and what the reservations of their requests
        that never ended booked. Their files become sealed segments of this spool, deleted by the `release` after the
        rows are written and those reservations settled."""
        rows: dict[str, LedgerRow] = {}
        marks: dict[str, tuple[LedgerRow, object, Segment]] = {}
        for path in sorted(self._directory.glob(f"*{_SUFFIX}"), key=_started):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # released by its owner meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a live process's (this one's own included)
                continue
            if os.fstat(fd).st_nlink == 0:  # written and released by its owner between the listing and the lock
                os.close(fd)
                continue
            segment = Segment(path, fd)
            with open(fd, "rb", closefd=False) as file:
                segment.lines = _read(file.read(), segment, rows, marks)
            self._sealed.append(segment)
        running = [(row, booked, segment) for row, booked, segment in marks.values() if row.id not in rows]
        reservations = []
        for _, booked, segment in running:
            if booked is not None:
                segment.running += 1  # kept until it is settled, as for a request still running
                reservations.append((booked, functools.partial(LedgerSpool.ended, segment)))
        return Adopted([*rows.values(), *(row for row, _, _ in running)], reservations)

    def close(self) -> None:
        """At the end: the segments' rows are in the store (released) or stay for the next process to adopt; an
        empty segment is removed."""
        for segment in (*self._sealed, self._current):
            if not segment.lines:
                segment.path.unlink(missing_ok=True)
            os.close(segment.fd)
        self._sealed.clear()


def _write(segment: Segment, line: bytes) -> None:
    """One write of one line; a line cut short (a full disk) raises, and the next starts on a line of its own."""
    if segment.torn:
        line = b"\n" + line
    segment.torn = os.write(segment.fd, line) < len(line)
    if segment.torn:
        raise OSError(errno.ENOSPC, "a line was cut short")
    segment.lines += 1


def _started(path: Path) -> int:
    """When a segment was started, from its name (`<pid>-<ns>.rows`): a stat could find it gone."""
    started = path.stem.rpartition("-")[2]
    return int(started) if started.isdigit() else 0


def _read(data: bytes, segment: Segment, rows: dict[str, LedgerRow],
          marks: dict[str, tuple[LedgerRow, object, Segment]]) -> int:
    """A segment's rows and marks (their `died` rows, what their reservations booked, the segment), by id, into
    `rows` and `marks`; how many lines it has."""
    lines = data.splitlines()
    skipped = 0
    for line in lines:
        if not line:
            continue  # ends a line a full disk cut short
        try:
            value = orjson.loads(line)
            if isinstance(value, dict) and "dropped" in value:  # after its mark, in the same segment
                marks.pop(value["dropped"], None)
            elif isinstance(value, dict):
                if not isinstance(mark := value["open"], list):
                    raise TypeError("a mark is a list")
                row = died(mark)
                # d3188ee..7fb2452 (27 November 2026) wrote the reservation as the mark's ninth value
                booked = value["booked"] if "booked" in value else mark[8] if len(mark) > 8 else None
                marks[row.id] = (row, booked, segment)
            else:
                row = LedgerRow(*value)
                rows[row.id] = row
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):  # torn, or not this version's columns
            skipped += 1
    if skipped:
        _logger.error("usage ledger: %d unreadable line(s) in %s skipped", skipped, segment.path)
    return len(lines)
