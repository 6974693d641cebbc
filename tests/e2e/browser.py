"""A real browser for the console tests: Debian's chromium driven by Playwright for Python.

Playwright's own browser downloads cannot work here (and are never needed): it launches the Debian binary. The flags
keep Chromium off the network (no background requests, updates or sync) and able to run as root in a container.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def require_chromium() -> None:
    """`make test` installs chromium; a developer running pytest by hand without it is told, CI fails."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is missing: run `make test` (it installs Debian's chromium)")


@dataclass
class PageProblems:
    """What a page complained about: script errors, failed loads, Content-Security-Policy violations."""

    lines: list[str] = field(default_factory=list)

    def watch(self, page) -> None:
        page.on("pageerror", lambda error: self.lines.append(f"page error: {error}"))
        page.on("console", lambda message: message.type == "error" and self.lines.append(
            f"console: {message.text}"))


@contextlib.contextmanager
def chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    require_chromium()
    assert shutil.which("chromium") or Path(CHROMIUM).exists()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()
