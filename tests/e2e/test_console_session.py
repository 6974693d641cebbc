"""The admin console's session in a real browser: what an operator sees when the signed-in admin key stops working
or the gateway goes away while the console is open, and a key's limits as the gateway enforces them.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import expect

import server
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SIGNED_OUT = "Signed out: the admin key is no longer valid."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The default catalog, with a price on family-a-5.5 so that its requests count against budgets, and a limit per
    key on family-a-5.4."""
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    next(m for m in config["models"] if m["id"] == "family-a-5.5")["price"] = {"input": 1, "output": 2}
    config["limits"]["models"] = {"family-a-5.4": {"requests_per_minute": 9}}
    path = tmp_path_factory.mktemp("console-session-config") / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(tmp_path_factory.mktemp("console-session-data"), "--dev-key", config=path) as gateway:
        yield gateway


def admin_key(gateway, name: str) -> tuple[str, str]:
    made = gateway.cli("keys", "create", "--name", name, "--all-models", "--admin").stdout.split()
    return made[2], made[-1]


def refused_calls_aside(lines: list[str]) -> list[str]:
    return [line for line in lines if "the server responded with a status of 401" not in line]


def test_an_admin_key_revoked_while_a_form_is_open_signs_out(tab, gateway):
    """Saving with a revoked admin key used to leave the form open with "Incorrect API key provided.", as if the key
    being edited were wrong, and the console signed in with a key that no longer works."""
    admin_id, secret = admin_key(gateway, "revoked-meanwhile")
    target = gateway.cli("keys", "create", "--name", "edited", "--all-models").stdout.split()[2]
    tab.sign_in(secret)
    tab.open(f"#/keys/{target}")
    page = tab.page
    page.get_by_role("button", name="Edit").click()
    page.get_by_role("dialog").get_by_label("Requests per minute").fill("42")
    gateway.cli("keys", "revoke", admin_id)
    page.wait_for_timeout(1500)  # keys.cache_seconds
    page.get_by_role("dialog").get_by_role("button", name="Save").click()
    expect(page.get_by_role("dialog")).to_have_count(0)
    expect(page.get_by_role("status")).to_have_text(SIGNED_OUT)
    expect(page.get_by_label("Admin key")).to_be_visible()
    expect(page.get_by_role("navigation")).to_be_hidden()
    tab.shot("signed-out-mid-edit")
    assert refused_calls_aside(tab.problems.lines) == []


def test_the_gateway_going_away_while_the_console_is_open(browser, tmp_path):
    """Every page and form says the gateway cannot be reached, and the form stays usable for a retry."""
    from tests.e2e.browser import Tab

    with running_gateway(tmp_path / "gone-data", "--dev-key") as gone:
        _, secret = admin_key(gone, "ops")
        tab = Tab(browser, gone, tmp_path)
        tab.sign_in(secret)
        expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
        tab.page.get_by_role("button", name="Create key").click()
        tab.page.get_by_role("dialog").get_by_label("Name").fill("made-too-late")
    try:
        page = tab.page
        dialog = page.get_by_role("dialog")
        dialog.get_by_role("button", name="Create key").click()
        expect(dialog.get_by_role("alert")).to_have_text("The gateway could not be reached: check that it is "
                                                         "running, then try again.")
        expect(dialog.get_by_role("button", name="Create key")).to_be_enabled()
        dialog.get_by_role("button", name="Cancel").click()
        for name in ("Usage", "Models", "Keys"):
            page.get_by_role("navigation").get_by_role("link", name=name).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Something went wrong")
            expect(page.get_by_role("alert")).to_contain_text("could not be reached")
            expect(page.locator("main")).not_to_have_attribute("aria-busy", "true")
        tab.shot("gateway-gone")
        assert [line for line in tab.problems.lines if "ERR_CONNECTION_REFUSED" not in line] == []
    finally:
        tab.context.close()


def test_leaving_the_console_for_another_page_signs_out(browser, gateway, tmp_path):
    """Chromium keeps a page left for another whole in its back/forward cache (which Playwright turns off unless
    asked): Back brought the console back signed in, the admin key still in its memory, for whoever used the browser
    next. Leaving signs out, as reloading or closing the tab does."""
    from tests.e2e.browser import CHROMIUM, FLAGS, Tab

    _, secret = admin_key(gateway, "ops-back")
    cached = browser.browser_type.launch(executable_path=CHROMIUM, args=FLAGS,
                                         ignore_default_args=["--disable-back-forward-cache"])
    try:
        tab = Tab(cached, gateway, tmp_path)
        tab.sign_in(secret)
        expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
        tab.page.evaluate("window.leftWhole = true")  # still set only on a page the cache brought back
        tab.page.goto("data:text/html,<link rel=icon href=data:,><p>Another site")
        tab.page.go_back(wait_until="commit")  # a page from the cache fires no load event
        expect(tab.page.get_by_label("Admin key")).to_be_visible()
        assert tab.page.evaluate("window.leftWhole") is True
        expect(tab.page.get_by_role("status")).to_have_text("Signed out: you left the console.")
        expect(tab.page.get_by_role("navigation")).to_be_hidden()
        expect(tab.page.locator("main table")).to_have_count(0)
        assert tab.problems.lines == []
    finally:
        cached.close()


def test_a_keys_limits_say_what_the_gateways_defaults_are(tab, gateway):
    """"gateway default" alone left the operator to guess whether a default limit exists (requests per minute:
    600) or none does (tokens per day); the key's page says which, from the limits in force."""
    _, secret = admin_key(gateway, "ops-limits")
    key_id = gateway.cli("keys", "create", "--name", "own-rpm", "--all-models", "--rpm", "100").stdout.split()[2]
    tab.sign_in(secret)
    tab.open(f"#/keys/{key_id}")
    limits = tab.page.locator("dl.limits")
    expect(limits.locator("dd")).to_have_text([
        "100 (its own)", "1,000,000 (gateway default)", "32 (gateway default)", "no limit (gateway default)",
        "no limit (gateway default)", "no budget (gateway default)", "no budget (gateway default)"])
    assert tab.problems.lines == []


def contrast(one: str, other: str) -> float:
    """WCAG's contrast ratio of two CSS colours given as rgb(r, g, b)."""
    def luminance(colour: str) -> float:
        channels = [int(c) / 255 for c in re.findall(r"\d+", colour)[:3]]
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    high, low = sorted((luminance(one), luminance(other)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_keyboard_focus_and_error_messages_stand_out(tab, gateway):
    """The focus ring was amber (#ffb000) at 1.8:1 on white: below the 3:1 WCAG asks of a focus indicator."""
    _, secret = admin_key(gateway, "ops-focus")
    tab.open()
    page = tab.page
    page.get_by_label("Admin key").fill("pk-wrong")
    page.keyboard.press("Enter")
    error = page.get_by_role("alert")
    expect(error).to_contain_text("not valid")
    assert contrast(error.evaluate("e => getComputedStyle(e).color"), "rgb(255, 255, 255)") >= 4.5
    page.get_by_label("Admin key").fill(secret)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    for backdrop in ("header", "main"):  # the navigation's grey band, and the page
        page.keyboard.press("Tab")
        while page.evaluate(f"!document.activeElement.closest('{backdrop}')"):
            page.keyboard.press("Tab")
        ring = page.evaluate("getComputedStyle(document.activeElement).outlineColor")
        behind = page.locator(backdrop).first.evaluate("e => getComputedStyle(e).backgroundColor")
        behind = "rgb(255, 255, 255)" if behind == "rgba(0, 0, 0, 0)" else behind
        assert contrast(ring, behind) >= 3, (backdrop, ring, behind)


def test_html_in_a_key_name_is_shown_as_text(tab, gateway):
    """A name is whatever an admin typed: the console sets it as text on every page, chart legend and dialog."""
    from tests.e2e.browser import api

    _, secret = admin_key(gateway, "ops-xss")
    name = "<img src=x onerror=alert(1)><script>alert(2)</script>"
    made = api(gateway, secret, "POST", "/v1/admin/keys", json={"name": name, "all_models": True}).json()
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert api(gateway, made["secret"], "POST", "/v1/chat/completions", json=chat).status_code == 200
    tab.page.wait_for_timeout(1200)  # usage.flush_seconds
    alerts = []
    tab.page.on("dialog", lambda dialog: (alerts.append(dialog.message), dialog.dismiss()))
    tab.sign_in(secret)
    expect(tab.page.get_by_role("link", name=name)).to_be_visible()
    tab.open(f"#/keys/{made['key']['id']}")
    expect(tab.page.get_by_role("heading", name=name, level=1)).to_be_visible()
    tab.page.get_by_role("button", name="Revoke").click()
    expect(tab.page.get_by_role("dialog")).to_contain_text(f"Revoke “{name}”?")
    tab.page.get_by_role("dialog").get_by_role("button", name="Cancel").click()
    tab.open("#/usage?period=24h&group=api_key_id&bucket=hour")
    expect(tab.page.locator("#chart-requests .u-legend")).to_contain_text(name)
    assert tab.page.locator("main img, main script, body > dialog img").count() == 0 and alerts == []


# The characters of an element's text in the order they are drawn (line by line, left to right).
DRAWN = """(element) => {
  const drawn = [];
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.length; i++) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const box = range.getBoundingClientRect();
      if (box.width > 0 && node.data[i].trim()) drawn.push([Math.round(box.top / 4), box.left, node.data[i]]);
    }
  }
  return drawn.sort((a, b) => a[0] - b[0] || a[1] - b[1]).map((c) => c[2]).join("");
}"""


def assert_drawn(locator, text: str) -> None:
    """The element shows `text` (spaces aside) in reading order, once its page has settled."""
    deadline = time.monotonic() + 10
    while (drawn := locator.evaluate(DRAWN)) != text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert drawn == text


def test_a_right_to_left_override_in_a_name_is_written_out(tab, gateway):
    """A name holding U+202E (right-to-left override) was drawn as another name ("read-only-admin") and reversed the
    text after it: the revoke dialog read `Revoke “?”read-only-admin`, the usage table and chart legend showed the
    key's id backwards (`(b788d99fb4a34d9a_yek)`), as did the message after revoking. Such a control is now written
    out as `<U+202E>`: the name is told as it is, and the rest reads in order."""
    from tests.e2e.browser import api

    _, secret = admin_key(gateway, "ops-bidi")
    name = "\u202enimda-ylno-daer"  # drawn as "read-only-admin"
    made = api(gateway, secret, "POST", "/v1/admin/keys", json={"name": name, "all_models": True}).json()
    key_id = made["key"]["id"]
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert api(gateway, made["secret"], "POST", "/v1/chat/completions", json=chat).status_code == 200
    tab.page.wait_for_timeout(1200)  # usage.flush_seconds
    tab.sign_in(secret)
    shown = "<U+202E>nimda-ylno-daer"
    expect(tab.page.get_by_role("link", name=shown)).to_be_visible()
    tab.open("#/usage?period=24h&group=api_key_id&bucket=hour")
    link = tab.page.locator(f'main table a[href="#/keys/{key_id}"]')
    assert_drawn(link, f"{shown}({key_id})")
    legend = tab.page.locator("#chart-requests .u-legend .u-label", has_text=key_id)
    assert_drawn(legend, f"{shown}({key_id})")
    tab.open(f"#/keys/{key_id}")
    tab.page.get_by_role("button", name="Revoke").click()
    assert_drawn(tab.page.get_by_role("dialog").get_by_role("heading"), f"Revoke“{shown}”?")
    tab.page.get_by_role("dialog").get_by_role("button", name="Revoke key").click()
    assert_drawn(tab.page.get_by_role("status"), f"Revokedkey{shown}.")
    assert tab.problems.lines == []


def test_a_monthly_budget_resets_in_days(tab, gateway):
    """A month's budget resets at the month's end: "101 h 42 min" left the operator to divide by 24."""
    from tests.e2e.browser import api

    _, secret = admin_key(gateway, "ops-month")
    made = gateway.cli("keys", "create", "--name", "monthly", "--all-models", "--max-spend-month", "100").stdout.split()
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert api(gateway, made[-1], "POST", "/v1/chat/completions", json=chat).status_code == 200
    status = api(gateway, secret, "GET", f"/v1/admin/keys/{made[2]}/limits").json()["limits"]
    reset = next(s["reset_seconds"] for s in status if s["limit"] == "max_spend_month")
    days = int(reset // 86400)
    tab.sign_in(secret)
    tab.open(f"#/keys/{made[2]}")
    row = tab.page.get_by_role("region", name="What the key has used").get_by_role(
        "row", name=re.compile("^Budget per month"))
    if days:  # on a month's last day it is hours and minutes, as for a day's budget
        expect(row.get_by_role("cell").last).to_have_text(re.compile(rf"^({days}|{days - 1}) d \d{{1,2}} h$"))
    assert tab.problems.lines == []


def test_a_gateway_that_stops_answering_is_told_not_waited_for(browser, gateway, tmp_path):
    """A hung gateway (here: stopped with SIGSTOP) accepts the connection and never answers: the form waited for
    ever, its button disabled under a "progress" cursor. After 30 seconds the console says so."""
    import os
    import signal

    from tests.e2e.browser import Tab

    _, secret = admin_key(gateway, "ops-hung")
    tab = Tab(browser, gateway, tmp_path)
    tab.page.clock.install()  # its timers, fast-forwarded below (time otherwise flows as usual)
    try:
        tab.sign_in(secret)
        page = tab.page
        page.get_by_role("button", name="Create key").click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_label("Name").fill("made-while-hung")
        os.killpg(gateway.process.pid, signal.SIGSTOP)
        try:
            dialog.get_by_role("button", name="Create key").click()
            expect(dialog.get_by_role("button", name="Create key")).to_be_disabled()
            page.clock.fast_forward(31_000)
            expect(dialog.get_by_role("alert")).to_contain_text("did not answer within 30 seconds")
            expect(dialog.get_by_role("button", name="Create key")).to_be_enabled()
        finally:
            os.killpg(gateway.process.pid, signal.SIGCONT)
        assert [line for line in tab.problems.lines if "ERR_" not in line] == []
    finally:
        tab.context.close()


def test_a_page_that_arrives_after_sign_out_is_not_shown(tab, gateway):
    """Signing out while a page loads: the page's answers arrived after, and the page (the catalog, say) replaced
    the sign-in form, its data on screen with no one signed in."""
    import os
    import signal

    _, secret = admin_key(gateway, "ops-late")
    tab.sign_in(secret)
    page = tab.page
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    os.killpg(gateway.process.pid, signal.SIGSTOP)  # the page's requests wait, unanswered
    try:
        page.get_by_role("navigation").get_by_role("link", name="Models").click()
        page.wait_for_timeout(300)
        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_label("Admin key")).to_be_visible()
    finally:
        os.killpg(gateway.process.pid, signal.SIGCONT)
    page.wait_for_timeout(1500)  # the answers arrive
    expect(page.get_by_role("heading", level=1)).to_have_text("Sign in")
    expect(page.get_by_label("Admin key")).to_be_visible()
    expect(page.get_by_role("status")).to_have_text("Signed out.")
    assert tab.problems.lines == []


def test_each_page_has_its_own_title(tab, gateway):
    """Every page was titled "Portico console": the browser's history and tabs, and a screen reader's first words,
    could not tell the key page from the usage page."""
    _, secret = admin_key(gateway, "ops-titles")
    tab.open()
    expect(tab.page).to_have_title("Sign in — Portico console")
    tab.sign_in(secret)
    expect(tab.page).to_have_title("Keys — Portico console")
    for name in ("Usage", "Models"):
        tab.page.get_by_role("navigation").get_by_role("link", name=name).click()
        expect(tab.page).to_have_title(f"{name} — Portico console")
    assert tab.problems.lines == []


def test_a_page_that_takes_its_time_says_it_is_loading(tab, gateway):
    """A slow answer (a month per hour on a large ledger, a busy gateway) left the previous page on screen with no
    sign that the click was taken."""
    import os
    import signal

    _, secret = admin_key(gateway, "ops-slow")
    tab.sign_in(secret)
    page = tab.page
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    os.killpg(gateway.process.pid, signal.SIGSTOP)
    try:
        page.get_by_role("navigation").get_by_role("link", name="Usage").click()
        expect(page.locator("main").get_by_text("Loading…")).to_be_visible()
    finally:
        os.killpg(gateway.process.pid, signal.SIGCONT)
    expect(page.get_by_role("heading", name="Usage", level=1)).to_be_visible()
    expect(page.locator("main").get_by_text("Loading…")).to_have_count(0)
    assert tab.problems.lines == []


def test_a_keys_page_shows_the_limits_of_the_models_it_may_call(tab, gateway):
    """A limit on family-a-5.4 was listed on the page of a key that may call only family-a-5.5, as if it applied."""
    _, secret = admin_key(gateway, "ops-model-limits")
    narrow = gateway.cli("keys", "create", "--name", "narrow", "--models", "family-a-5.5").stdout.split()[2]
    wide = gateway.cli("keys", "create", "--name", "wide", "--all-models").stdout.split()[2]
    tab.sign_in(secret)
    for key_id, shown in ((wide, 1), (narrow, 0)):
        tab.open(f"#/keys/{key_id}")
        left = tab.page.get_by_role("region", name="What the key has used")
        expect(left.get_by_role("row", name=re.compile("^Requests per minute all its models"))).to_have_count(1)
        expect(left.get_by_role("row", name=re.compile("on family-a-5.4"))).to_have_count(shown)
    assert tab.problems.lines == []


def test_a_rotation_left_while_on_its_way_still_shows_the_new_secret(tab, gateway):
    """Escape (or Cancel) while a slow gateway rotated the key closed the form; the rotation happened and its new
    secret was never shown: with a grace of 0 the key could no longer be used by anyone."""
    import os
    import signal

    from tests.e2e.browser import api

    _, secret = admin_key(gateway, "ops-impatient")
    made = gateway.cli("keys", "create", "--name", "rotated-slowly", "--all-models").stdout.split()
    tab.sign_in(secret)
    tab.open(f"#/keys/{made[2]}")
    page = tab.page
    page.get_by_role("button", name="Rotate secret").click()
    page.get_by_role("dialog").get_by_label("Grace period in seconds").fill("0")
    os.killpg(gateway.process.pid, signal.SIGSTOP)
    try:
        page.get_by_role("dialog").get_by_role("button", name="Rotate").click()
        page.wait_for_timeout(300)
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
    finally:
        os.killpg(gateway.process.pid, signal.SIGCONT)
    shown = page.get_by_role("dialog", name=re.compile("^New secret")).get_by_label("Secret")
    expect(shown).to_have_value(re.compile(r"^pk-"))
    assert api(gateway, shown.input_value(), "GET", "/v1/models").status_code == 200
    assert tab.problems.lines == []


def test_a_reset_two_minutes_away_reads_as_two_minutes(tab, gateway):
    """Shortly before UTC midnight a daily limit's reset (119.3 s away) read "1 min 60 s". The gateway's answer is
    altered in the browser: the time of day cannot be chosen."""
    _, secret = admin_key(gateway, "ops-midnight")
    made = gateway.cli("keys", "create", "--name", "daily", "--all-models", "--daily-requests", "50").stdout
    key_id = made.split()[2]

    def near_midnight(route):
        answer = route.fetch().json()
        for status in answer["limits"]:
            status["reset_seconds"] = 119.3 if status["limit"] == "daily_requests" else status["reset_seconds"]
        route.fulfill(json=answer)

    tab.page.route(re.compile(r".*/limits$"), near_midnight)
    tab.sign_in(secret)
    tab.open(f"#/keys/{key_id}")
    row = tab.page.get_by_role("region", name="What the key has used").get_by_role(
        "row", name=re.compile("^Requests per day"))
    expect(row.get_by_role("cell").last).to_have_text("2 min 0 s")
    assert tab.problems.lines == []


def test_a_page_the_gateway_could_not_answer_is_shown_once_it_is_back(tab, gateway):
    """The gateway restarted while the Models page was open: "could not be reached", and once it was back, neither
    the page's own link nor anything else on the page loaded it again; reloading signs out. Now "Try again" and the
    page's link in the navigation do."""
    _, secret = admin_key(gateway, "ops-retry")
    tab.sign_in(secret)
    page = tab.page
    nav = page.get_by_role("navigation")
    # Signed in, and the first page loaded: the sign-in form could still be in #main beside "Loading…".
    expect(page.locator("#main .sign-in")).to_have_count(0)
    expect(page.locator("#main")).not_to_have_attribute("aria-busy", "true")
    for retry in (lambda: page.get_by_role("button", name="Try again").click(),
                  lambda: nav.get_by_role("link", name="Models").click()):
        # The link of the page shown loads it again: its list must be in before the gateway goes, or that load
        # (begun by a hashchange event, so maybe not yet when the click returns) runs into the outage too, and a
        # load still under way when the gateway is back would show the page without "Try again".
        page.locator("#main > *").evaluate("page => { page.dataset.before = 'yes'; }")
        nav.get_by_role("link", name="Keys").click()
        expect(page.locator("#main > :not([data-before])")).to_have_count(1)  # the page loaded again
        expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
        expect(page.locator("#main")).not_to_have_attribute("aria-busy", "true")  # (networkidle: no wait on a hash)
        page.route("**/v1/**", lambda route: route.abort("connectionrefused"))  # the gateway is down
        nav.get_by_role("link", name="Models").click()
        expect(page.get_by_role("heading", level=1)).to_have_text("Something went wrong")
        expect(page.get_by_role("alert")).to_contain_text("could not be reached")
        page.unroute("**/v1/**")  # and back
        expect(page.locator("#main")).not_to_have_attribute("aria-busy", "true")  # nothing left to re-render it
        retry()
        expect(page.get_by_role("heading", name="Models", level=1)).to_be_visible()
        expect(page).to_have_title("Models — Portico console")
    assert [line for line in tab.problems.lines if "ERR_CONNECTION_REFUSED" not in line] == []


def test_a_key_can_be_seen_and_revoked_while_the_limit_store_is_down(browser, tmp_path):
    """With the Redis limit store down, a key's page was only "Something went wrong: The limit store is
    unreachable": no way to look at a key, or revoke a leaked one, in the console until Redis was back, though the
    key store answered. The page is shown, its "Left now" says why it cannot be read."""
    from tests.e2e.browser import Tab
    from tests.redis_support import start_redis

    (tmp_path / "redis").mkdir()
    redis = start_redis(tmp_path / "redis")
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    config["limits"]["store"] = redis.url
    path = tmp_path / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        with running_gateway(tmp_path / "redis-gone-data", "--dev-key", config=path) as gone:
            _, secret = admin_key(gone, "ops")
            leaked = gone.cli("keys", "create", "--name", "leaked", "--all-models").stdout.split()[2]
            redis.stop()
            tab = Tab(browser, gone, tmp_path)
            try:
                tab.sign_in(secret)
                tab.open(f"#/keys/{leaked}")
                page = tab.page
                expect(page.get_by_role("heading", name="leaked", level=1)).to_be_visible()
                expect(page.locator("main")).to_contain_text("The limit store is unreachable")
                # The defaults in force are not known either: not "no limit" (this one has 600 requests a minute).
                expect(page.locator("dl.limits")).not_to_contain_text("no limit")
                page.get_by_role("button", name="Revoke").click()
                page.get_by_role("dialog").get_by_role("button", name="Revoke key").click()
                expect(page.get_by_role("status")).to_have_text("Revoked key leaked.")
                expect(page.locator("main")).to_contain_text("✕ revoked")
                tab.shot("limit-store-down")
                assert [line for line in tab.problems.lines if "status of 503" not in line] == []
            finally:
                tab.context.close()
    finally:
        redis.stop()
