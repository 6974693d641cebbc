"""Files that hold anything about keys, users or their requests are private to the service's user.

Portico's processes run with umask 077, so everything they create (the data dir, keys.db and its WAL/SHM, the
usage ledger, generated images, image-link.key, envoy.log, the run dir's sockets, a file access log) is readable
by its owner alone, whoever creates it first. `make_private` also tightens what an older version left readable, and
`take_others_access` a file access log kept elsewhere.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from server.config_providers import ConfigError
from server.data_dir import DataDir

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
    group/other access away from what an older version left readable. The data dir and Portico's files in it must be
    this user's (`check_owner`); anything else there (a lost+found, an operator's own file) is not Portico's
    business, and out of others' reach in a 0700 data dir anyway."""
    os.umask(PRIVATE_UMASK)
    for path, info in _checked_paths(data_dir):
        if not stat.S_ISDIR(info.st_mode) and path == Path(os.path.abspath(data_dir)):
            return  # a file named as the data dir is none (make_data_dir refuses it): not Portico's to change
        try:
            if info.st_mode & _OTHERS and not path.is_symlink():  # a link's target is not Portico's to change
                path.chmod(stat.S_IMODE(info.st_mode) & ~_OTHERS)
        except FileNotFoundError:
            pass  # removed meanwhile (an image swept by another process)


def check_owner(data_dir: Path) -> None:
    """Files are private to their owner (umask 077), so a data dir, or a file in it, that another user made (an
    operator's `portico keys create` or `serve` as root before the service's user ran it; a second user's `portico
    keys` on the service's data dir) cannot be read or written by this user: one line naming it, its owner and what
    to do, not SQLite's "unable to open database file" or a traceback once the model has loaded. Root may read
    anything, and is not checked."""
    for _ in _checked_paths(data_dir):
        pass


def _checked_paths(data_dir: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Each of Portico's paths that exists, with its status, once `check_owner`'s checks passed for it: the data dir,
    then what Portico makes in it, each directory before its files (listed only once it was found to be this
    user's)."""
    me = os.geteuid()
    data_dir = Path(os.path.abspath(data_dir))  # named whole in what is said: "data" is the working directory's
    files = DataDir(data_dir)
    for path in (data_dir, *files.files, *files.directories):
        if (info := _checked(path, me, data_dir)) is not None:
            yield path, info
    for directory in files.directories:
        try:
            listed = sorted(directory.iterdir())
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for path in listed:
            if (info := _checked(path, me, data_dir)) is not None:
                yield path, info


def _checked(path: Path, me: int, data_dir: Path) -> os.stat_result | None:
    """The status of `path` (None when it is not there), or a ConfigError when this user cannot use it."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # not made yet (make_data_dir says why it cannot be)
    except PermissionError:  # a directory on its path this user may not enter (/root/data)
        raise ConfigError(f"data_dir: cannot reach {path} (Permission denied): portico runs as {user_name(me)} "
                          f"here, which may not enter a directory on that path: choose a data dir "
                          f"{user_name(me)} may reach (--data-dir, data_dir)") from None
    if me == 0:
        return info
    if (owner := info.st_uid) != me:
        # Root's files are a command run as root by mistake: running the service as root is not the cure.
        other_user = "" if owner == 0 else f"run portico as {user_name(owner)}, or "
        raise ConfigError(f"data_dir: {path} belongs to {user_name(owner)}, and portico runs as {user_name(me)} "
                          f"here: {other_user}give the data dir to {user_name(me)} "
                          f"(chown -R {user_name(me)}: {data_dir})")
    # Its owner's and still closed to it (chmod 500, 400): SQLite said only "attempt to write a readonly
    # database", and a read-only keys.db let the gateway start, then drop every usage-ledger row.
    wanted, letters = (0o700, "rwx") if stat.S_ISDIR(info.st_mode) else (0o600, "rw")
    if info.st_mode & wanted != wanted:
        raise ConfigError(f"data_dir: {path} is mode {stat.S_IMODE(info.st_mode):04o}: portico must read and "
                          f"write it (chmod u+{letters} {path})")
    return info


def act_as_owner(data_dir: Path) -> None:
    """Root's `portico keys` or `usage` on a data dir that belongs to another user (the service's) runs as that user,
    as `sudo -u` would: a key store it made, or a WAL it left, was root's, and the service's next start could not
    open it. Then the data dir must be that user's throughout (check_owner)."""
    if os.geteuid() != 0:
        return
    try:
        owner = data_dir.stat()
    except OSError:
        return  # not made yet: made as root, as by any command root runs (check_owner says so at the service's start)
    if owner.st_uid == 0:
        return
    os.setgroups([])
    os.setgid(owner.st_gid)
    os.setuid(owner.st_uid)
    check_owner(data_dir)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a name (a file from another machine or container)
        return f"uid {uid}"


def make_data_dir(path: Path) -> None:
    """The data dir, or a directory in it (made 0700 under PRIVATE_UMASK), when missing: a path that cannot be one
    (a file is there, a parent is a file, no permission) is one line naming it, not a traceback later."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # FileExistsError's own words, "File exists", read as nothing wrong
        reason = "a file is there, not a directory" if isinstance(exc, FileExistsError) else exc.strerror
        # Whole: a relative data_dir ("data", the default) is the working directory's, which the line should name.
        raise ConfigError(f"data_dir: cannot create {os.path.abspath(path)} ({reason})") from None
