"""The run directory of `portico serve`: Envoy's config, the server sockets, the metrics files, the health board.

It lives under the system temp dir (TMPDIR: unix socket paths are limited to ~108 bytes) and is removed at the end.
A serve that was killed (SIGKILL, the OOM killer) could not remove its own, and a unit restarted after each kill
left one per crash, on a tmpfs in memory: each run directory holds a lock that its serve keeps for its whole life
(the kernel drops it when the process dies, however it dies), and a serve starting sweeps the directories of its
user whose lock nobody holds any more.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_PREFIX = "portico-"
_LOCK = "serve.lock"
# A directory this young may be another serve's, made a moment ago and not yet locked: never swept.
_SETTLED_SECONDS = 60.0

_logger = logging.getLogger(__name__)


@contextlib.contextmanager
def run_directory() -> Iterator[Path]:
    """A new run directory, locked while the block runs, removed after it; stale ones of dead serves swept first."""
    _sweep(Path(tempfile.gettempdir()))
    run_dir = Path(tempfile.mkdtemp(prefix=_PREFIX))
    lock = os.open(run_dir / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)  # not inherited by Envoy
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield run_dir
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir)
        os.close(lock)


def _sweep(temp: Path) -> None:
    """Removes the run directories of this user's serves that are gone. Only a directory with a lock file is one
    (an older Portico's has none, and may still be running): its lock free is its serve dead."""
    now = time.time()
    for entry in temp.glob(f"{_PREFIX}*/{_LOCK}"):
        try:
            info = entry.stat()
            if info.st_uid != os.getuid() or now - info.st_mtime < _SETTLED_SECONDS:
                continue
            lock = os.open(entry, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile, or not ours to open
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            continue  # held: its serve runs
        try:
            shutil.rmtree(entry.parent, ignore_errors=True)
            _logger.info("removed the run directory of a serve that ended without removing it: %s", entry.parent)
        finally:
            os.close(lock)
