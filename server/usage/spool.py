"""The ledger's spool: each row is appended to a file in `<data_dir>/ledger-spool/` as it is queued, so that a
process killed before its writer's next batch (`kill -9`, out of memory) loses no row of a request it answered:
the next process to start on the data dir (the worker that replaces it, or `portico serve` started again) adopts
the dead process's files and writes their rows.

A process holds an exclusive flock on each segment file it has: the lock dies with the process, so a segment whose
lock can be taken has no live owner. A write pass seals the segment being appended to and starts a new one; once
every row queued before the seal is in the store, the sealed segments are deleted. One row is one line (its values
in COLUMNS order, as JSON); a line that does not parse (the host, not the process, died mid-write) is skipped,
logged. Rows are in the page cache once written: a dying process loses none, a dying host may.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from server.config_providers import ConfigError
from server.usage.ledger import LedgerRow, values_of

_logger = logging.getLogger(__name__)

_SUFFIX = ".rows"


@dataclass(slots=True)
class _Segment:
    path: Path
    fd: int  # open, and locked by this process
    rows: int = 0
    torn: bool = False  # a full disk took part of a row: the next one starts on a line of its own


class LedgerSpool:
    def __init__(self, directory: Path) -> None:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:  # a file in its place: one line at start, not a traceback
            raise ConfigError(f"data_dir: cannot create {directory} ({exc.strerror})") from None
        self._directory = directory
        self._sealed: list[_Segment] = []
        self._current = self._new_segment()

    def _new_segment(self) -> _Segment:
        self._directory.mkdir(mode=0o700, exist_ok=True)  # deleted under a running process: made again
        path = self._directory / f"{os.getpid()}-{time.time_ns()}{_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return _Segment(path, fd)

    def append(self, row: LedgerRow) -> None:
        """One write of one line: a process killed after it returns has the row on disk. Raises OSError, also when
        only part of the line could be written."""
        segment = self._current
        data = orjson.dumps(values_of(row), option=orjson.OPT_APPEND_NEWLINE)
        if segment.torn:
            data = b"\n" + data
        segment.torn = os.write(segment.fd, data) < len(data)
        if segment.torn:
            raise OSError(errno.ENOSPC, "a row was cut short")
        segment.rows += 1

    def seal(self) -> None:
        """Rows appended from now on go to a new segment; the ones before wait in sealed segments for `release`.
        Raises OSError when no segment can be started: the current one then goes on taking rows."""
        if self._current.rows:
            segment = self._new_segment()
            self._sealed.append(self._current)
            self._current = segment

    def release(self) -> None:
        """Every row of the sealed segments is in the store (or was refused by it, logged): they go."""
        for segment in self._sealed:
            segment.path.unlink(missing_ok=True)
            os.close(segment.fd)
        self._sealed.clear()

    def adopt(self) -> list[LedgerRow]:
        """The rows of the segments no live process holds, oldest first. Their files become sealed segments of this
        spool, deleted by the `release` after the rows are written."""
        rows: list[LedgerRow] = []
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
            with open(fd, "rb", closefd=False) as file:
                found = _rows_of(file.read(), path)
            rows += found
            self._sealed.append(_Segment(path, fd, len(found)))
        return rows

    def close(self) -> None:
        """At the end: the segments' rows are in the store (released) or stay for the next process to adopt; an
        empty segment is removed."""
        for segment in (*self._sealed, self._current):
            if not segment.rows:
                segment.path.unlink(missing_ok=True)
            os.close(segment.fd)
        self._sealed.clear()


def _started(path: Path) -> int:
    """When a segment was started, from its name (`<pid>-<ns>.rows`): a stat could find it gone."""
    started = path.stem.rpartition("-")[2]
    return int(started) if started.isdigit() else 0


def _rows_of(data: bytes, path: Path) -> list[LedgerRow]:
    rows, skipped = [], 0
    for line in data.splitlines():
        if not line:
            continue  # ends a row a full disk cut short
        try:
            rows.append(LedgerRow(*orjson.loads(line)))
        except (orjson.JSONDecodeError, TypeError):  # torn, or not a row of this version's columns
            skipped += 1
    if skipped:
        _logger.error("usage ledger: %d unreadable line(s) in %s skipped", skipped, path)
    return rows
