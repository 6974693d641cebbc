"""Files that hold anything about keys, users or their requests are private to the service's user.

Portico's processes run with umask 077, so everything they create (the data dir, keys.db and its WAL/SHM, the
usage ledger, generated images, image-link.key, envoy.log, the run dir's sockets, a file access log) is readable
by its owner alone, whoever creates it first. `make_private` also tightens what an older version left readable, and
`take_others_access` a file access log kept elsewhere.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from server.config_providers import ConfigError

PRIVATE_UMASK = 0o077
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def take_others_access(path: Path) -> None:
    """Group/other access off one regular file kept outside the data dir (a file access log; not a device such as
    /dev/stdout, whose terminal would change)."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) and mode & _OTHERS:
        try:
            path.chmod(stat.S_IMODE(mode) & ~_OTHERS)
        except PermissionError:
            pass  # another user's file we may only append to: its owner decides who reads it


def make_private(data_dir: Path) -> None:
    """Set umask 077 for this process (and its children), so `data_dir` is made 0700 when first needed, and take
    group/other access away from what is already there."""
    os.umask(PRIVATE_UMASK)
    if not data_dir.is_dir():
        return
    for path in (data_dir, *data_dir.rglob("*")):
        try:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and mode & _OTHERS:
                path.chmod(stat.S_IMODE(mode) & ~_OTHERS)
        except FileNotFoundError:
            pass  # removed meanwhile (an image swept by another process)


def make_data_dir(path: Path) -> None:
    """The data dir, or a directory in it (made 0700 under PRIVATE_UMASK), when missing: a path that cannot be one
    (a file is there, a parent is a file, no permission) is one line naming it, not a traceback later."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # FileExistsError's own words, "File exists", read as nothing wrong
        reason = "a file is there, not a directory" if isinstance(exc, FileExistsError) else exc.strerror
        raise ConfigError(f"data_dir: cannot create {path} ({reason})") from None
