"""The console's files, read into memory once at start-up from build/console (made by `make install`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from server.errors import NotFound

BUILT_DIR = Path(__file__).resolve().parents[2] / "build" / "console"
INDEX = "index.html"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}

# Sent with every file. The page loads nothing but its own files and talks to nothing but this origin, so a script
# injected into it could not load more code or send a key elsewhere; it cannot be framed (clickjacking); no URL of
# it ever leaves as a referrer. no-cache: a browser revalidates, so a new version is seen after an upgrade.
HEADERS = (
    ("content-security-policy",
     "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConsoleFile:
    content_type: str
    data: bytes


class ConsoleFiles:
    """Files by their path below /console/. Only files found at start-up exist: a request names a dict entry, never
    a filesystem path, so no request can reach outside the directory."""

    def __init__(self, directory: Path = BUILT_DIR) -> None:
        self._files = _read(directory)
        if INDEX not in self._files:
            _logger.warning("the admin console is not built (%s is missing): run `make install`", directory / INDEX)

    def get(self, path: str) -> ConsoleFile:
        found = self._files.get(path.strip("/") or INDEX)
        if found is None:
            if not self._files:
                raise NotFound("The admin console is not built on this server: run `make install`.")
            raise NotFound(f"Unknown console file: /console/{path}.")
        return found


def _read(directory: Path) -> dict[str, ConsoleFile]:
    if not directory.is_dir():
        return {}
    return {
        path.relative_to(directory).as_posix(): ConsoleFile(CONTENT_TYPES[path.suffix], path.read_bytes())
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.suffix in CONTENT_TYPES
    }
