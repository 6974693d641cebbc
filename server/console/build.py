"""Build the console: copy what a browser loads into build/console (run by `make install`, after `npm ci` in web/).

No bundler: the app is plain ES modules that a browser loads as they are, and uPlot ships an ES module build, so
building is copying. Nothing is fetched at run time; the page loads only these files.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from server.console.files import BUILT_DIR

WEB = Path(__file__).resolve().parent / "web"
# (from, to): the app's own files, then the pinned libraries it imports (web/package-lock.json).
SOURCES = (
    (WEB / "src", Path(".")),
    (WEB / "node_modules" / "uplot" / "dist" / "uPlot.esm.js", Path("vendor") / "uPlot.esm.js"),
    (WEB / "node_modules" / "uplot" / "dist" / "uPlot.min.css", Path("vendor") / "uPlot.min.css"),
    (WEB / "node_modules" / "uplot" / "LICENSE", Path("vendor") / "uPlot.LICENSE.txt"),
)


def build(out: Path = BUILT_DIR) -> None:
    missing = [str(source) for source, _ in SOURCES if not source.exists()]
    if missing:
        sys.exit(f"console sources missing (run `npm ci` in {WEB}): {', '.join(missing)}")
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    for source, target in SOURCES:
        if source.is_dir():
            # copyfile, not copytree's copy2: the copies are as new as the build, so make sees index.html (its
            # target) up to date and a second `make serve` does not run `npm ci` and this build again.
            shutil.copytree(source, staging / target, dirs_exist_ok=True, copy_function=shutil.copyfile)
        else:
            (staging / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / target)
    # Swap whole: a server starting meanwhile reads the old build or the new one, never half of each.
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


if __name__ == "__main__":
    build()
