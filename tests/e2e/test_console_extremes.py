"""The admin console in a real browser with the numbers and data a large gateway holds: billions of tokens, costs
of thousands of dollars to the micro-dollar, and the operations an operator does on them.

A gateway of its own, whose ledger gets rows written into it (as the gateway writes them) on days months past, read as
chosen days, so no other test's rows are in the period shown.
"""

from __future__ import annotations

import re
import sqlite3
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import expect

from server.domain import Endpoint
from server.usage.ledger import LedgerRow, values_of
from server.usage.query import insert_sql

from tests.e2e.browser import api, new_admin_secret, new_key
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
DAY = 86_400


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("console-extremes-data"), "--dev-key") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_secret(gateway) -> str:
    return new_admin_secret(gateway)


def seed(gateway, key_id: str, *, days_ago: int, tokens: int, cost_micros: int) -> str:
    """One answered chat request of `tokens` in and `tokens` out, `days_ago` UTC days ago at 12:00; returns that day."""
    at = (int(time.time()) // DAY - days_ago) * DAY + DAY // 2
    row = LedgerRow(id=uuid.uuid4().hex, at_ms=at * 1000, request_id=uuid.uuid4().hex, key_id=key_id, env="",
                    endpoint=Endpoint.CHAT.value, model="family-a-5.5", upstream="family-a-5.5", status=200, code="",
                    input_tokens=tokens, output_tokens=tokens, cached_input_tokens=0, images=0,
                    cost_micros=cost_micros, upstream_attempts=1, latency_ms=120, first_token_ms=None)
    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
        db.execute(insert_sql("?"), values_of(row))
    return time.strftime("%Y-%m-%d", time.gmtime(at))


# Every text a page draws on a canvas (uPlot's axes), recorded as drawn.
RECORD_CANVAS_TEXT = """window.drawnTexts = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  window.drawnTexts.push(String(text));
  return fillText.call(this, text, ...rest);
};"""

# Each totals card whose value's text reaches past the card's own edge: [label, value, px past].
CARDS_PAST_THEIR_EDGE = """() => [...document.querySelectorAll(".card")].map((card) => {
  const value = card.querySelector(".value"), range = document.createRange();
  range.selectNodeContents(value);
  return [card.querySelector(".label").textContent, value.textContent,
          range.getBoundingClientRect().right - card.getBoundingClientRect().right];
}).filter(([, , past]) => past > 0)"""


@pytest.mark.parametrize("width", [1280, 390])
def test_a_large_gateways_totals_stay_inside_their_cards(tab, gateway, admin_secret, width):
    """A week of 30 billion tokens, or a cost to the micro-dollar over a thousand dollars ($12,345.678912), ran out of
    its card at 1280 px and over the next card's figure ("30,000,000,00030,000,000,000")."""
    day = seed(gateway, new_key(gateway, f"heavy-{width}"), days_ago=100 + width // 10, tokens=30_000_000_000,
               cost_micros=12_345_678_912)
    tab.page.set_viewport_size({"width": width, "height": 800})
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.open(f"#/usage?from={day}&to={day}&group=model&bucket=day")
    totals = tab.page.get_by_role("list", name="Totals", exact=False)
    expect(totals.get_by_role("listitem").filter(has_text="Cost").locator(".value")).to_have_text("$12,345.678912")
    expect(totals.get_by_role("listitem").filter(has_text="Input tokens").locator(".value")).to_have_text(
        "30,000,000,000")
    tab.shot(f"usage-large-totals-{width}")
    assert tab.page.evaluate(CARDS_PAST_THEIR_EDGE) == []
    tab.no_horizontal_scroll()
    assert tab.problems.lines == []


def test_a_chart_of_billions_of_tokens_has_its_value_axis(tab, gateway, admin_secret):
    """Tokens past about 6 billion in a bucket had no value axis at all (uPlot found no step in the console's list of
    whole-number steps, which ended at 1 billion): a line without a scale."""
    day = seed(gateway, new_key(gateway, "billions"), days_ago=200, tokens=20_000_000_000, cost_micros=1_000_000)
    tab.page.add_init_script(RECORD_CANVAS_TEXT)
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.page.evaluate("window.drawnTexts = []")
    tab.open(f"#/usage?from={day}&to={day}&group=model&bucket=hour")
    expect(tab.page.locator("#chart-tokens canvas")).to_have_count(1)
    tab.page.wait_for_timeout(300)  # drawn on the next animation frame
    drawn = tab.page.evaluate("window.drawnTexts")
    assert [text for text in drawn if re.fullmatch(r"\d{1,3}(,000){3,}", text)], drawn  # 10,000,000,000, say
    tab.shot("usage-billions-of-tokens")
    assert tab.problems.lines == []


@pytest.mark.parametrize("name", ["   ", "\u00a0", "  padded  "])
def test_a_key_named_with_spaces_around_or_only_can_be_opened_and_edited(tab, gateway, admin_secret, name):
    """The API takes a name of spaces only (a script's unset variable) or with spaces around it. Such a key's link in
    the keys list was blank, nothing to click, and its page's heading empty; its Edit refused any change with "Give
    the key a name.", or renamed "  padded  " to "padded" when only a limit was changed: a name the operator had not
    touched was sent."""
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": name, "all_models": True, "env": "blank"})
    key_id = made.json()["key"]["id"]
    tab.sign_in(admin_secret)
    tab.open(f"#/keys?env=blank&q={key_id}")
    link = tab.page.get_by_role("region", name="API keys").get_by_role("link")
    expect(link).to_have_text(name.strip() or "(unnamed)")
    link.click()
    expect(tab.page.get_by_role("heading", level=1)).to_have_text(name.strip() or key_id)
    tab.page.get_by_role("button", name="Edit").click()
    dialog = tab.page.get_by_role("dialog")
    dialog.get_by_label("Requests per minute").fill("7")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_have_count(0)
    key = api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]
    assert (key["name"], key["limits"]) == (name, {"requests_per_minute": 7})
    assert tab.problems.lines == []


def test_a_double_enter_does_not_close_a_secret_shown_once(tab, gateway, admin_secret):
    """Enter pressed twice (a habit, or a heavy finger) in Create key's Name field, or in Rotate's grace: the first
    created the key (rotated the secret), the second closed its secret's dialog on Done, which had the focus. The
    secret, shown only once, was gone before it could be read; with a grace of 0 the key's only working one."""
    tab.sign_in(admin_secret)
    page = tab.page
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    page.get_by_role("button", name="Create key").click()
    page.get_by_role("dialog").get_by_label("Name").fill("double-enter")
    for _ in range(2):
        page.keyboard.press("Enter")
        page.wait_for_timeout(300)
    secret = page.get_by_role("dialog", name="Key “double-enter” created").get_by_label("Secret")
    expect(secret).to_have_value(re.compile(r"^pk-"))
    page.get_by_role("button", name="Done").click()
    expect(page.get_by_role("heading", name="double-enter", level=1)).to_be_visible()

    page.get_by_role("button", name="Rotate secret").click()
    page.get_by_role("dialog").get_by_label("Grace period in seconds").fill("0")
    for _ in range(2):
        page.keyboard.press("Enter")
        page.wait_for_timeout(300)
    rotated = page.get_by_role("dialog", name="New secret for “double-enter”").get_by_label("Secret")
    expect(rotated).to_have_value(re.compile(r"^pk-"))
    page.get_by_role("button", name="Done").click()
    expect(page.get_by_role("dialog")).to_have_count(0)
    assert tab.problems.lines == []


def seed_now(gateway, key_id: str, ago_s: float = 60) -> None:
    """One answered chat request (10 tokens in, 5 out, $0.0001) `ago_s` seconds ago."""
    at = int((time.time() - ago_s) * 1000)
    row = LedgerRow(id=uuid.uuid4().hex, at_ms=at, request_id=uuid.uuid4().hex, key_id=key_id, env="",
                    endpoint=Endpoint.CHAT.value, model="family-a-5.5", upstream="family-a-5.5", status=200, code="",
                    input_tokens=10, output_tokens=5, cached_input_tokens=0, images=0, cost_micros=100,
                    upstream_attempts=1, latency_ms=30, first_token_ms=None)
    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
        db.execute(insert_sql("?"), values_of(row))


def test_requests_written_while_the_usage_page_loads_never_make_other_negative(tab, gateway, admin_secret):
    """A busy gateway writes requests into the period while the page reads it (a request is written when it ends).
    The page read each hour's total first and the drawn keys' hours after: with requests written in between, the
    drawn keys summed to more than the total, and "other" (the total less theirs) was negative, "-3" requests, the
    line below the chart's floor."""
    keys = [new_key(gateway, f"busy-{i}") for i in range(8)]  # more than the charts draw: two are "other"
    for key_id in keys:
        seed_now(gateway, key_id)
    written = []

    def write_meanwhile(route):
        if not written and "api_key_ids=" in route.request.url and "bucket_width=all" not in route.request.url:
            drawn = parse_qs(urlsplit(route.request.url).query)["api_key_ids"][0]
            for _ in range(5):
                seed_now(gateway, drawn, ago_s=1)  # as the gateway writes requests that just ended
            written.append(drawn)
        route.continue_()

    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.page.route(re.compile(r"/v1/organization/usage/completions\?"), write_meanwhile)
    tab.open("#/usage?period=24h&group=api_key_id&bucket=hour")
    chart = tab.page.locator("#chart-requests")
    expect(chart.locator("canvas")).to_have_count(1)
    assert written
    chart.get_by_text("Show the numbers").click()
    numbers = chart.locator("details table")
    assert numbers.locator("thead th").last.inner_text() == "other"
    others = [row.locator("td").last.inner_text() for row in numbers.locator("tbody tr").all()]
    assert [count for count in others if count.startswith("-")] == [], others
    assert tab.problems.lines == []


def test_a_revoked_key_can_still_be_renamed(tab, gateway, admin_secret):
    """A revoked key's name, environment, grants and limits can still be changed (api.md, Key administration), and
    its name labels its spend on the usage page for as long as the ledger keeps it; its page had no Edit at all, so
    an operator could not mark a leaked key as such from the console."""
    key_id = new_key(gateway, "old-billing")
    assert api(gateway, admin_secret, "POST", f"/v1/admin/keys/{key_id}/revoke").status_code == 200
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.open(f"#/keys/{key_id}")
    expect(tab.page.get_by_role("heading", name="old-billing", level=1)).to_be_visible()
    expect(tab.page.get_by_role("button", name="Rotate secret")).to_have_count(0)  # a revoked key has no secret to
    expect(tab.page.get_by_role("button", name="Revoke")).to_have_count(0)  # rotate, nor one to revoke
    tab.page.get_by_role("button", name="Edit").click()
    dialog = tab.page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("old-billing (leaked)")
    dialog.get_by_role("button", name="Save").click()
    expect(tab.page.get_by_role("heading", name="old-billing (leaked)", level=1)).to_be_visible()
    expect(tab.page.locator("dl.facts").first).to_contain_text("✕ revoked")
    assert api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]["name"] == "old-billing (leaked)"
    assert tab.problems.lines == []


def test_a_cost_axis_of_micro_dollars_has_no_ticks_between_them(tab, gateway, admin_secret):
    """A cheap model's hour of $0.000001 drew its cost axis with ticks every $0.0000002, each written to the
    micro-dollar: "$0.00", "$0.00", "$0.00", "$0.000001", "$0.000001", "$0.000001", a scale that reads as nonsense."""
    day = seed(gateway, new_key(gateway, "frugal"), days_ago=250, tokens=10, cost_micros=1)
    tab.page.add_init_script(RECORD_CANVAS_TEXT)
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.page.evaluate("window.drawnTexts = []")
    tab.open(f"#/usage?from={day}&to={day}&group=model&bucket=hour")
    expect(tab.page.locator("#chart-cost canvas")).to_have_count(1)
    tab.page.wait_for_timeout(300)  # drawn on the next animation frame
    dollars = [text for text in tab.page.evaluate("window.drawnTexts") if text.startswith("$")]
    assert "$0.000001" in dollars, dollars
    assert [a for a, b in zip(dollars, dollars[1:]) if a == b] == [], dollars  # each tick its own amount
    tab.shot("usage-micro-dollar-axis")
    assert tab.problems.lines == []


@pytest.mark.parametrize("per, days", [("day", 1_200), ("hour", 400)])
def test_a_long_period_has_dates_on_its_time_axis(browser, gateway, admin_secret, tmp_path, per, days):
    """Chosen days over a few years per day (a ledger kept for ever: `usage.retention_days: 0`), or over a year per
    hour, drew every chart without a single date or grid line on its time axis: the console's widest time step was
    56 days (28 per hour). Checked in a browser east of UTC, whose days are not the axis's."""
    from tests.e2e.browser import DESKTOP, PageProblems

    seed(gateway, new_key(gateway, f"long-{per}"), days_ago=300, tokens=10, cost_micros=100)
    context = browser.new_context(viewport=DESKTOP, base_url=gateway.base_url, timezone_id="Pacific/Kiritimati")
    page = context.new_page()
    page.set_default_timeout(60_000)
    problems = PageProblems()
    problems.watch(page)
    page.add_init_script(RECORD_CANVAS_TEXT)
    page.goto("/console/")
    page.get_by_label("Admin key").fill(admin_secret)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    first, last = (time.strftime("%Y-%m-%d", time.gmtime(time.time() - ago * DAY)) for ago in (days, 0))
    page.evaluate("window.drawnTexts = []")
    page.goto(f"/console/#/usage?from={first}&to={last}&group=model&bucket={per}")
    expect(page.locator(".window")).to_contain_text(f"per {per}", timeout=60_000)
    expect(page.locator("#chart-requests canvas")).to_have_count(1)
    page.wait_for_timeout(300)  # drawn on the next animation frame
    dates = [text.split("\n")[-1] for text in page.evaluate("window.drawnTexts")
             if re.search(r"\d{4}-\d\d-\d\d$", text)]
    assert dates, page.evaluate("window.drawnTexts")
    assert {date[8:] for date in dates} == {"01"}, dates  # the 1st of a month, in UTC
    page.screenshot(path=tmp_path / f"usage-long-per-{per}.png", full_page=True)
    context.close()
    assert problems.lines == []


def test_a_browser_whose_clock_is_behind_the_gateways_still_shows_requests_just_made(tab, gateway, admin_secret):
    """An operator's laptop ten minutes behind the gateway (no time sync): requests just made, in the key's recent
    requests, were in none of the pages' figures, which ended at the browser's "now": the key's last 7 days and the
    usage page's last 24 hours said "No requests", the models page 0. Periods that end now end at the gateway's now."""
    caller = new_key(gateway, "skewed-clock")
    seed_now(gateway, caller, ago_s=60)
    tab.page.clock.install(time=time.time() - 600)
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.open(f"#/keys/{caller}")
    recent = tab.page.get_by_role("region", name="The key's last 25 requests", exact=False)
    expect(recent.locator("tbody tr")).to_have_count(1)
    week = tab.page.get_by_role("region", name="The key's use of each model, last 7 days")
    expect(week.get_by_role("row", name=re.compile("^family-a-5.5")).get_by_role("cell").first).to_have_text("1")
    tab.open("#/usage?period=24h&group=api_key_id&bucket=hour")
    spend = tab.page.get_by_role("region", name="Spend by key and model, Last 24 hours")
    expect(spend.get_by_role("row", name=f"skewed-clock ({caller}) family-a-5.5")).to_be_visible()
    tab.shot("usage-clock-behind")
    assert tab.problems.lines == []


@pytest.mark.parametrize("query", ["from=2026-02-30&to=2026-03-05", "from=2026-03-01&to=2026-02-31"])
def test_a_link_with_a_day_no_month_has_makes_no_period(tab, gateway, admin_secret, query):
    """A typed or edited link with February 30 was read as March 2 (the browser's date parser rolls a day over): the
    page said "2026-02-30 to 2026-03-05" over the figures of other days, and "2026-03-01 to 2026-02-31" over March 1
    to 3. Such a day makes no period, as a day to come does: said so, and which period is shown instead."""
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.open(f"#/usage?{query}")
    expect(tab.page.locator(".window")).to_contain_text("per")
    alert = tab.page.locator("main").get_by_role("alert").filter(has_text="make no period")
    expect(alert).to_contain_text("This week (since Monday, UTC) is shown instead")
    assert tab.problems.lines == []


def test_many_keys_are_listed_a_page_at_a_time(tab, gateway, admin_secret):
    """A gateway of many keys (30,000 made by a script) drew every one of them as a row of one table: the keys page
    took seconds to appear, with a scroll bar of a mile. It shows 100 at a time, newest first, with links to the
    previous and next hundred; the filters still search them all."""
    base = int(time.time()) - 10 * DAY
    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:  # as a script's CreateKey calls leave them
        db.executemany("INSERT INTO api_keys (id, name, secret_hash, all_models, models, env, created) "
                       "VALUES (?, ?, ?, 1, '', 'bulk', ?)",
                       [(f"key_bulk{i:012x}", f"bulk-{i}", uuid.uuid4().hex + uuid.uuid4().hex, base + i)
                        for i in range(1050)])
    newest_first = [f"key_bulk{i:012x}" for i in reversed(range(1050))]
    total = f'{len(api(gateway, admin_secret, "GET", "/v1/admin/keys").json()["keys"]):,}'
    tab.sign_in(admin_secret)
    tab.open("#/keys?env=bulk")
    listed = lambda: [href.removeprefix("#/keys/") for href in tab.page.get_by_role("region", name="API keys")
                      .get_by_role("link").evaluate_all("links => links.map((link) => link.getAttribute('href'))")]
    assert listed() == newest_first[:100]
    expect(tab.page.locator("p.count")).to_have_text(f"1,050 of {total} keys: 1–100 shown")
    pages = tab.page.get_by_role("navigation", name="Pages of keys")
    expect(pages.get_by_role("link", name="Previous")).to_have_count(0)
    pages.get_by_role("link", name="Next").click()
    expect(tab.page.locator("p.count")).to_have_text(f"1,050 of {total} keys: 101–200 shown")
    assert listed() == newest_first[100:200]
    assert "env=bulk" in tab.page.url and "page=2" in tab.page.url  # filters kept, and the page can be bookmarked
    tab.open("#/keys?env=bulk&page=99")  # past the last page: the last one
    expect(tab.page.locator("p.count")).to_have_text(f"1,050 of {total} keys: 1,001–1,050 shown")
    assert listed() == newest_first[1000:]
    expect(pages.get_by_role("link", name="Next")).to_have_count(0)
    expect(pages.get_by_role("link", name="Previous")).to_have_attribute("href", "#/keys?env=bulk&page=10")
    tab.page.get_by_label("Name or id").fill("bulk-7")  # a new search starts at its first page
    tab.page.get_by_role("button", name="Filter").click()
    expect(tab.page.locator("p.count")).to_have_text(f"111 of {total} keys: 1–100 shown")
    tab.shot("keys-a-page-of-many")
    assert tab.problems.lines == []
