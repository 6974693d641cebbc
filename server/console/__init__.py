"""The admin console: a browser app at /console/ that is a client of the admin API (docs/console.md).

Its source is `web/` (plain ES modules, uPlot for the charts, pinned in web/package-lock.json); `python -m
server.console.build` copies what a browser loads into build/console at install time, and `ConsoleFiles` serves
that directory from memory.
"""

from server.console.files import ConsoleFile, ConsoleFiles

__all__ = ["ConsoleFile", "ConsoleFiles"]
