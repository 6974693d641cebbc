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

import httpx
import pytest
from playwright.sync_api import expect

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


# Resolves once the console's own hashchange listener (added before this one) has started the new page's render.
_GO_TO_HASH = """hash => new Promise(resolve => {
  addEventListener("hashchange", () => resolve(), {once: true});
  const before = location.href;
  location.hash = hash;
  if (location.href === before) resolve();  // the page already shown: no hashchange
})"""


class Tab:
    """One browser tab on the console, and what its pages complained about."""

    def __init__(self, browser, gateway, shots, viewport=DESKTOP) -> None:
        self.context = browser.new_context(viewport=viewport, base_url=gateway.base_url)
        self.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.base_url)
        self.base_url = gateway.base_url
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.problems = PageProblems()
        self.problems.watch(self.page)
        self.shots = shots

    def open(self, hash_: str = "") -> None:
        """The console at this page, once shown: on a console already loaded (signed in), a new hash is the same
        document, whose previous page stays up until the new one's data is in."""
        if hash_ and self.page.url.startswith(f"{self.base_url}/console/"):
            self.page.evaluate(_GO_TO_HASH, hash_)
        else:
            self.page.goto(f"/console/{hash_}")
        expect(self.page.locator("#main[aria-busy]")).to_have_count(0)
        expect(self.page.get_by_role("heading", level=1)).to_be_visible()

    def sign_in(self, secret: str) -> None:
        self.open()
        self.page.get_by_label("Admin key").fill(secret)
        self.page.get_by_role("button", name="Sign in").click()
        # Signed in once the gateway took the key: a page opened before that would race the sign-in's own render.
        expect(self.page.get_by_role("button", name="Sign out")).to_be_visible()

    def shot(self, name: str) -> None:
        self.page.screenshot(path=self.shots / f"{name}.png", full_page=True)

    def no_horizontal_scroll(self) -> None:
        assert self.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def new_admin_secret(gateway, name: str = "ops-admin") -> str:
    """The secret of a new admin key granted every model (made with the CLI, as an operator signs in with)."""
    return gateway.cli("keys", "create", "--name", name, "--all-models", "--admin").stdout.split()[-1]


def new_key(gateway, name: str) -> str:
    """The id of a new key granted every model."""
    return gateway.cli("keys", "create", "--name", name, "--all-models").stdout.split()[2]


def api(gateway, secret: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{gateway.base_url}{path}", headers={"Authorization": f"Bearer {secret}"},
                         timeout=30, **kwargs)
