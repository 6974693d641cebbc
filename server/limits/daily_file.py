"""The in-process store's day and month counters on disk, so a restart does not refund daily quotas and budgets.

One JSON object, scope id -> [day, day_requests, day_tokens, day_spend, month, month_spend], replaced atomically
(written beside, then renamed) so a crash mid-write leaves the previous file. Counters of a past day or month are
reset on first use as always (see memory._Counters.catch_up).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

_logger = logging.getLogger(__name__)

Row = tuple[int, int, int, int, int, int]


def load_daily(path: Path) -> dict[str, Row]:
    """The saved counters; none if there is no file yet, or it cannot be read (logged: quotas start afresh)."""
    try:
        raw = orjson.loads(path.read_bytes())
        return {str(scope): tuple(int(n) for n in row) for scope, row in raw.items() if len(row) == 6}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        _logger.error("daily limit counters in %s could not be read (%s): today's quotas start from zero", path, exc)
        return {}


def save_daily(path: Path, rows: dict[str, Row]) -> None:
    """Raises OSError (a full disk, a read-only data dir): the previous file is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    # Made anew, owner-only: a `.partial` a crash left readable by others would keep its mode if written again, and
    # the file renamed over limits-daily.json (every key's use) with it.
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(orjson.dumps(rows))
    os.replace(partial, path)
