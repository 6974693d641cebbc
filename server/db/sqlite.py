"""One configured SQLite connection. The key store and the usage ledger share the file `<data_dir>/keys.db`; WAL
lets the server, its worker processes and the CLI use it at once, and a writer waits (busy_timeout) instead of
failing while another one holds the lock."""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from pathlib import Path

BUSY_TIMEOUT_MS = 5000
_WAL_RETRY_SECONDS = 0.01


def connect_sqlite(path: Path, *, read_only: bool = False) -> sqlite3.Connection:
    """Autocommit mode (isolation_level=None): transactions are explicit (BEGIN ... COMMIT). Usable from any one
    thread at a time (check_same_thread=False): callers serialise their use. `read_only`: nothing is made or
    written (StoreSettings.read_only)."""
    if read_only:
        return sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None, check_same_thread=False,
                               timeout=BUSY_TIMEOUT_MS / 1000)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        _use_wal(db)
    except BaseException:
        db.close()
        raise
    return db


def _read_only_uri(path: Path) -> str:
    """SQLite reads a WAL database through its -wal and -shm files, and makes them when they are missing, which a
    directory it may not write in refuses ('unable to open database file'). They are missing when no connection has
    the database open (the last one to close folds the -wal into keys.db and removes both): keys.db is then whole,
    and is read as immutable, without them. With a -wal there (a process has it open, or died with it open), its rows
    are read too, through the -shm beside it."""
    uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
    if not os.path.exists(f"{path}-wal") and not os.access(path.parent, os.W_OK):
        uri += "&immutable=1"
    return uri


def failure(path: Path, exc: BaseException) -> str:
    """SQLite's words for a failure on the database `path`, and the file system's state when it is read-only or full:
    SQLite says 'unable to open database file' or 'disk I/O error' then, which sent an operator looking for a bug."""
    text = f"SQLite: {exc}"
    try:
        fs = os.statvfs(path.parent)
    except OSError:
        return text
    if fs.f_flag & os.ST_RDONLY:
        return f"{text} ({path.parent} is on a read-only file system)"
    if fs.f_bavail == 0:
        return f"{text} ({path.parent}: no space left on device)"
    if fs.f_files and fs.f_favail == 0:  # btrfs and others count no inodes: f_files 0
        return f"{text} ({path.parent}: no inodes left on device)"
    return text


def _use_wal(db: sqlite3.Connection) -> None:
    """Switch a new database file to WAL (the mode is then kept in the file). The switch needs the file to itself
    and SQLite reports "database is locked" at once, without its busy wait, while another connection holds any lock:
    two worker processes starting on a new data dir met that, and one of them exited. So wait here, as busy_timeout
    would."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        time.sleep(_WAL_RETRY_SECONDS)
