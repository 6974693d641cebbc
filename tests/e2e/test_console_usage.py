"""The console's usage page in a real browser: every figure covers exactly the chosen period, whatever "Per" and "By"
say, and its latency percentiles are the usage API's own, never made up from other buckets' or groups'.

A gateway of its own, whose ledger gets rows written into it (as the gateway writes them) for what real requests
cannot make: a request of 26 hours ago, and latencies known in advance.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
import uuid
from datetime import datetime, timezone
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import expect

from server.domain import Endpoint
from server.usage.ledger import LedgerRow, values_of
from server.usage.query import TEXT_ENDPOINTS, insert_sql

from tests.e2e.browser import api, new_admin_secret, new_key
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HOUR = 3600


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("console-usage-data"), "--dev-key") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_secret(gateway) -> str:
    return new_admin_secret(gateway)


def seed(gateway, key_id: str, *, model: str, ago_s: float, latency_ms: float, cost_micros: int = 100,
         endpoint: Endpoint = Endpoint.CHAT, cache_hit: bool = False) -> None:
    """One answered request (chat, or one image) in the gateway's SQLite ledger, `ago_s` seconds ago; `cache_hit`:
    answered from the response cache, which the gateway writes with no upstream, attempt, token or cost."""
    image, used = endpoint is Endpoint.IMAGES, not cache_hit
    row = LedgerRow(id=uuid.uuid4().hex, at_ms=int((time.time() - ago_s) * 1000), request_id=uuid.uuid4().hex,
                    key_id=key_id, env="", endpoint=endpoint.value, model=model, upstream=model if used else "",
                    status=200, code="", input_tokens=0 if image or cache_hit else 10,
                    output_tokens=0 if image or cache_hit else 5, cached_input_tokens=0, images=int(image),
                    cost_micros=cost_micros if used else 0, upstream_attempts=int(used), latency_ms=latency_ms,
                    first_token_ms=None)
    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
        db.execute(insert_sql("?"), values_of(row))


def show(tab, query: str, group: str, per: str) -> None:
    """The usage page for a URL query; waits for the view of this `group` ("model", "key") and `per`."""
    tab.open(f"#/usage?{query}")
    expect(tab.page.locator(".window")).to_contain_text(f"per {per}")
    expect(tab.page.locator("#chart-requests h2")).to_have_text(f"Requests by {group}")


def card(tab, label: str):
    totals = tab.page.get_by_role("list", name="Totals", exact=False)
    return totals.get_by_role("listitem").filter(has_text=label).locator(".value")


def ms(value: float) -> str:
    """As the page writes a latency: rounded half up, thousands separated."""
    return f"≈ {math.floor(value + 0.5):,} ms"


def test_the_last_24_hours_count_the_same_requests_per_hour_and_per_day(tab, gateway, admin_secret):
    old, recent = new_key(gateway, "day-old-spender"), new_key(gateway, "recent-caller")
    seed(gateway, old, model="family-a-5.5", ago_s=26 * HOUR, latency_ms=100, cost_micros=2_500_000)
    for _ in range(2):
        seed(gateway, recent, model="family-a-5.5", ago_s=60, latency_ms=40, cost_micros=6_500)
    tab.sign_in(admin_secret)
    shown = {}
    # The last 24 hours start at the hour a day ago: within a day (shown per hour, whichever bucket is asked for),
    # except in the hour after a UTC midnight, when they start at one.
    within_a_day = bool((time.time() - 24 * HOUR) // HOUR * HOUR % (24 * HOUR))
    for per in ("hour", "day"):
        show(tab, f"period=24h&group=model&bucket={per}", "model", "hour" if within_a_day else per)
        spend = tab.page.get_by_role("region", name="Spend by key and model, Last 24 hours")
        expect(spend.get_by_role("row", name=f"recent-caller ({recent}) family-a-5.5")).to_contain_text("$0.013")
        expect(spend).not_to_contain_text("day-old-spender")  # 26 hours old: before the period
        shown[per] = [card(tab, label).inner_text() for label in ("Requests", "Cost")]
        tab.shot(f"usage-24h-per-{per}")
    assert shown["hour"] == shown["day"] == ["2", "$0.013"]
    window = tab.page.locator(".window")
    if within_a_day:
        expect(window).to_contain_text("does not start at a UTC midnight, so it is shown per hour")
    else:
        expect(window).to_contain_text("00:00 UTC to now, per day.")
    # Whole UTC days can be shown per day: the last 7 days include the old request.
    show(tab, "period=7d&group=api_key_id&bucket=day", "key", "day")
    expect(tab.page.get_by_role("region", name="Spend by key and model, Last 7 days", exact=False)
           .get_by_role("row", name=f"day-old-spender ({old}) family-a-5.5")).to_contain_text("$2.50")
    assert tab.problems.lines == []


def test_latency_percentiles_are_the_periods_own_whatever_the_grouping(tab, gateway, admin_secret):
    fast, slow = new_key(gateway, "fast-caller"), new_key(gateway, "slow-caller")
    now = int(time.time())
    ago = min(60, now % HOUR / 2)  # in this hour, which is read below (60 s ago was the last hour in its first minute)
    for _ in range(3):
        seed(gateway, fast, model="family-a-5.5", ago_s=ago, latency_ms=20)
    seed(gateway, slow, model="family-a-5.4", ago_s=ago, latency_ms=4_000)
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    answer = api(gateway, admin_secret, "GET", "/v1/organization/usage/completions",
                 params={"start_time": now - now % 86_400, "bucket_width": "1d"}).json()
    whole_day = answer["data"][0]["results"][0]  # ungrouped, one bucket: the period's own percentiles

    tab.sign_in(admin_secret)
    for group, name in (("model", "model"), ("api_key_id", "key")):
        for per in ("hour", "day"):
            show(tab, f"from={today}&to={today}&group={group}&bucket={per}", name, per)
            expect(card(tab, "Latency p50")).to_have_text(ms(whole_day["latency_ms_p50"]))
            expect(card(tab, "Latency p95")).to_have_text(ms(whole_day["latency_ms_p95"]))
    tab.shot("usage-today-latency")

    # The last 24 hours span several buckets: no percentile of the period, each hour's own in the latency chart.
    show(tab, "period=24h&group=model&bucket=hour", "model", "hour")
    expect(card(tab, "Latency p95")).to_have_text("per hour, below")
    hour = api(gateway, admin_secret, "GET", "/v1/organization/usage/completions",
               params={"start_time": now - now % HOUR, "bucket_width": "1h"}).json()["data"][0]["results"][0]
    chart = tab.page.locator("#chart-latency")
    chart.get_by_text("Show the numbers").click()
    headers = chart.locator("thead th").all_inner_texts()
    this_hour = chart.locator("tbody tr").last.locator("th, td").all_inner_texts()
    assert this_hour[headers.index("p50")] == ms(hour["latency_ms_p50"])
    assert this_hour[headers.index("p95")] == ms(hour["latency_ms_p95"])
    assert tab.problems.lines == []


def test_costs_are_exact_and_an_image_model_has_no_request_count_to_show(tab, gateway, admin_secret):
    """Costs to the micro-dollar, as `portico usage` prints them (a cost of 39 micro-dollars is not "$0.0000"); the
    usage API counts chat and messages requests, so an image model shows its cost, and "—" for its requests."""
    caller = new_key(gateway, "tiny-spender")
    seed(gateway, caller, model="family-a-5.5", ago_s=60, latency_ms=30, cost_micros=39)
    seed(gateway, caller, model="family-a-image-2", ago_s=60, latency_ms=30, cost_micros=40_000,
         endpoint=Endpoint.IMAGES)
    tab.sign_in(admin_secret)
    show(tab, "period=24h&group=api_key_id&bucket=hour", "key", "hour")
    spend = tab.page.get_by_role("region", name="Spend by key and model, Last 24 hours")
    chat = spend.get_by_role("row", name=f"tiny-spender ({caller}) family-a-5.5")
    expect(chat.get_by_role("cell")).to_have_text(["family-a-5.5", "1", "10", "5", "$0.000039"])
    image = spend.get_by_role("row", name=f"tiny-spender ({caller}) family-a-image-2")
    expect(image.get_by_role("cell")).to_have_text(["family-a-image-2", "—", "—", "—", "$0.04"])

    tab.open(f"#/keys/{caller}")
    expect(tab.page.get_by_role("heading", name="Last 7 days: $0.040039")).to_be_visible()
    week = tab.page.get_by_role("region", name="The key's use of each model, last 7 days")
    expect(week.get_by_role("row", name="family-a-image-2").get_by_role("cell")).to_have_text(
        ["—", "—", "—", "—", "$0.04"])

    tab.page.get_by_role("navigation").get_by_role("link", name="Models").click()
    catalog = tab.page.get_by_role("region", name="The model catalog")
    image_row = catalog.get_by_role("row", name=re.compile("^family-a-image-2 "))
    expect(image_row).to_be_visible()  # the page has loaded: its headers are read at once, without waiting
    headers = catalog.locator("thead th").all_inner_texts()
    row = image_row.locator("th, td")
    expect(row.nth(headers.index("Requests"))).to_have_text("—")
    expect(row.nth(headers.index("Cost"))).to_have_text("$0.04")
    assert tab.problems.lines == []


def test_answers_from_the_response_cache_are_requests_on_every_page(tab, gateway, admin_secret):
    """A key sent three requests, two answered from the response cache (no tokens, no cost): it made three requests,
    as its recent requests list them, on the usage page, its own page and the models page alike."""
    caller = new_key(gateway, "cached-caller")
    model = "family-b-haiku-4-5-20251001"  # no other test here uses it: the models page's count is this key's
    seed(gateway, caller, model=model, ago_s=90, latency_ms=30, endpoint=Endpoint.MESSAGES)
    for _ in range(2):
        seed(gateway, caller, model=model, ago_s=60, latency_ms=1, endpoint=Endpoint.MESSAGES, cache_hit=True)
    tab.sign_in(admin_secret)
    show(tab, "period=24h&group=api_key_id&bucket=hour", "key", "hour")
    spend = tab.page.get_by_role("region", name="Spend by key and model, Last 24 hours")
    expect(spend.get_by_role("row", name=f"cached-caller ({caller}) {model}").get_by_role("cell")).to_have_text(
        [model, "3", "10", "5", "$0.0001"])

    expect_key_week_and_model_requests(tab, caller, model, 3)


def test_a_keys_recent_image_request_shows_its_images_not_tokens(tab, gateway, admin_secret):
    """An image request was "0 / 0" under Tokens in / out in a key's recent requests, as if it had used nothing."""
    caller = new_key(gateway, "painter")
    seed(gateway, caller, model="family-a-image-2", ago_s=30, latency_ms=900, endpoint=Endpoint.IMAGES)
    seed(gateway, caller, model="family-a-5.5", ago_s=20, latency_ms=40)
    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{caller}")
    recent = tab.page.get_by_role("region", name="The key's last 25 requests", exact=False)
    expect(recent.locator("tbody tr")).to_have_count(2)
    headers = recent.locator("thead th").all_inner_texts()
    used = headers.index("Tokens in / out, images")
    expect(recent.locator("tbody tr").nth(0).locator("th, td").nth(used)).to_have_text("10 / 5")
    expect(recent.locator("tbody tr").nth(1).locator("th, td").nth(used)).to_have_text("1 image")
    assert tab.problems.lines == []


def expect_key_week_and_model_requests(tab, caller: str, model: str, requests: int) -> None:
    """The key's page lists `requests` recent requests and counts them (10 tokens in, 5 out, $0.0001 in all) in its
    week's row of `model`, and the models page counts them for `model`."""
    tab.open(f"#/keys/{caller}")
    expect(tab.page.get_by_role("region", name="The key's last 25 requests", exact=False).locator("tbody tr")
           ).to_have_count(requests)
    week = tab.page.get_by_role("region", name="The key's use of each model, last 7 days")
    expect(week.get_by_role("row", name=re.compile(f"^{model}")).get_by_role("cell")).to_have_text(
        [str(requests), "0.0 % (0)", "10", "5", "$0.0001"])

    tab.page.get_by_role("navigation").get_by_role("link", name="Models").click()
    catalog = tab.page.get_by_role("region", name="The model catalog")
    model_row = catalog.get_by_role("row", name=re.compile(f"^{model} "))
    expect(model_row).to_be_visible()
    headers = catalog.locator("thead th").all_inner_texts()
    expect(model_row.locator("th, td").nth(headers.index("Requests"))).to_have_text(str(requests))
    assert tab.problems.lines == []


def test_a_request_of_this_second_is_in_the_weeks_of_the_key_and_models_pages(tab, gateway, admin_secret):
    """The key's and the models' last 7 days ended at this second, exclusive: a request made in it was in the key's
    recent requests but not in its week, nor in its model's requests on the models page."""
    caller = new_key(gateway, "this-second")
    model = "family-b-opus-4-6"  # no other test here uses it: the models page's count is this key's
    seed(gateway, caller, model=model, ago_s=0, latency_ms=30, endpoint=Endpoint.MESSAGES)
    [row] = api(gateway, admin_secret, "GET", f"/v1/organization/requests?api_key_ids={caller}").json()["data"]
    # The page is shown within the request's second.
    tab.page.clock.set_fixed_time(datetime.fromtimestamp(row["created"] + 0.5, timezone.utc))
    tab.sign_in(admin_secret)
    expect_key_week_and_model_requests(tab, caller, model, 1)


# Where a chart's first series (drawn in #0a5bd3) was painted, as shares of the canvas's width: (leftmost, rightmost).
FIRST_SERIES_SPAN = """canvas => {
  const {width, height} = canvas, pixels = canvas.getContext("2d").getImageData(0, 0, width, height).data;
  let left = width, right = -1;
  for (let i = 0; i < pixels.length; i += 4) {
    const close = Math.abs(pixels[i] - 10) + Math.abs(pixels[i + 1] - 91) + Math.abs(pixels[i + 2] - 211) < 60;
    const x = (i / 4) % width;
    if (close && pixels[i + 3] > 200) { left = Math.min(left, x); right = Math.max(right, x); }
  }
  return [left / width, right / width];
}"""


def test_a_period_of_one_bucket_is_drawn_inside_its_chart(tab, gateway, admin_secret):
    """Today per day is one point: uPlot's time axis for a single value spanned years and put the point on the
    chart's left edge, under the y axis labels."""
    seed(gateway, new_key(gateway, "single-point"), model="family-a-5.5", ago_s=60, latency_ms=30)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    tab.sign_in(admin_secret)
    show(tab, f"from={today}&to={today}&group=model&bucket=day", "model", "day")
    canvas = tab.page.locator("#chart-requests canvas")
    expect(canvas).to_have_count(1)
    tab.page.wait_for_timeout(300)  # drawn on the next animation frame
    left, right = canvas.evaluate(FIRST_SERIES_SPAN)
    assert 0.3 < left <= right < 0.8, (left, right)  # well inside the plot, not on its edge
    tab.shot("usage-single-point")
    assert tab.problems.lines == []


# Every text a page draws on a canvas (uPlot's axes), recorded as drawn.
RECORD_CANVAS_TEXT = """window.drawnTexts = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  window.drawnTexts.push(String(text));
  return fillText.call(this, text, ...rest);
};"""


def test_a_charts_time_axis_is_in_utc_days_or_hours_as_its_buckets(tab, gateway, admin_secret):
    """Day buckets were drawn on an axis of "12am 6am 12pm 6pm" ticks (US local style, no time zone): a day's total
    read as a value at midnight. The axis says UTC and, per day, names days only; per hour, 24-hour times."""
    seed(gateway, new_key(gateway, "axis-reader"), model="family-a-5.5", ago_s=2 * 86_400, latency_ms=30)
    tab.page.add_init_script(RECORD_CANVAS_TEXT)
    tab.sign_in(admin_secret)
    for per, label, tick in (("day", "Day (UTC)", r"^\d{4}-\d\d-\d\d$"), ("hour", "Hour (UTC)", r"^\d\d:00$")):
        tab.page.evaluate("window.drawnTexts = []")
        show(tab, f"period=7d&group=model&bucket={per}", "model", per)
        expect(tab.page.locator("#chart-latency canvas")).to_have_count(1)
        tab.page.wait_for_timeout(300)  # drawn on the next animation frame
        drawn = tab.page.evaluate("window.drawnTexts")
        assert label in drawn, drawn
        assert not [text for text in drawn if re.search(r"\d(am|pm)\b", text)], drawn
        assert [text for text in drawn if re.match(tick, text)], drawn
    assert tab.problems.lines == []


# Where each text drawn on a canvas starts, in canvas pixels: left of 0 is cut off by the canvas's edge.
RECORD_TEXT_EDGES = """window.drawnEdges = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, ...rest) {
  const width = this.measureText(text).width, align = this.textAlign, {a, b, e} = this.getTransform();
  const start = align === "right" || align === "end" ? x - width : align === "center" ? x - width / 2 : x;
  if (b === 0) window.drawnEdges.push([String(text), a * start + e]);
  return fillText.call(this, text, x, ...rest);
};"""


def test_a_charts_value_axis_has_room_for_its_widest_label(tab, gateway, admin_secret):
    """A thousand dollars or a second of latency did not fit the value axis: "$1,250.00" was drawn as ",1,250.00"
    and "≈ 1,000 ms" as "1,000 ms", their first characters cut off by the chart's left edge."""
    seed(gateway, new_key(gateway, "big-spender"), model="family-a-5.5", ago_s=60, latency_ms=1_500,
         cost_micros=1_234_567_891)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    tab.page.add_init_script(RECORD_TEXT_EDGES)
    tab.sign_in(admin_secret)
    show(tab, f"from={today}&to={today}&group=model&bucket=hour", "model", "hour")
    expect(tab.page.locator("#chart-latency canvas")).to_have_count(1)
    tab.page.wait_for_timeout(300)  # drawn on the next animation frame
    drawn = tab.page.evaluate("window.drawnEdges")
    assert [text for text, _ in drawn if text.startswith("$1,")], drawn  # the cost axis reaches the thousands
    assert [(text, left) for text, left in drawn if left < 0] == []
    tab.shot("usage-wide-axis-labels")
    assert tab.problems.lines == []


def test_a_period_without_requests_has_no_latency_to_point_to(tab, gateway, admin_secret):
    """The latency cards of a period of several days said "per day, below", pointing to a chart that said "No
    requests in this period." They say "—", as the error rate does."""
    day = 86_400
    first, last = (time.strftime("%Y-%m-%d", time.gmtime(time.time() - days * day)) for days in (400, 398))
    tab.sign_in(admin_secret)
    show(tab, f"from={first}&to={last}&group=model&bucket=day", "model", "day")
    expect(tab.page.locator("#chart-latency")).to_contain_text("No requests in this period.")
    for label in ("Requests", "Error rate", "Latency p50", "Latency p95"):
        expect(card(tab, label)).to_have_text("0" if label == "Requests" else "—")
    assert tab.problems.lines == []


@pytest.mark.parametrize("label, steps, applied", [
    ("By", 1, "group=api_key_id"), ("Per", -1, "bucket=hour"), ("Period", 1, "period=month"),
])
def test_enter_on_a_usage_filter_applies_it(tab, admin_secret, label, steps, applied):
    """A keyboard user who chose in a select and pressed Enter (as in the Keys page's search, or these days' fields)
    saw nothing happen: only a Tab to Show and Enter there applied it. Enter applies it, and the focus stays."""
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    show(tab, "period=7d&group=model&bucket=day", "model", "day")
    control = tab.page.get_by_label(label, exact=True)
    control.focus()
    tab.page.keyboard.press("ArrowDown" if steps > 0 else "ArrowUp")
    tab.page.keyboard.press("Enter")
    expect(tab.page).to_have_url(re.compile(re.escape(applied)))
    expect(tab.page.locator(".window")).to_be_visible()
    expect(tab.page.get_by_label(label, exact=True)).to_be_focused()
    assert tab.problems.lines == []


def usd(micros: int) -> str:
    """As the page writes an amount: at least cents, more digits only when they matter."""
    whole, fraction = divmod(micros, 1_000_000)
    return f"${whole:,}." + f"{fraction:06d}".rstrip("0").ljust(2, "0")


def test_thirty_days_by_key_ask_for_what_the_page_shows_and_equal_the_ledger(tab, gateway, admin_secret):
    """30 days by key asked for every day by key and model, for its table and charts: a download that grew with days x
    keys x models (106 MB for 2,200 keys). The page asks for the period's totals by key and model (one bucket), each
    day's totals and each day of the keys it draws, and shows the ledger's numbers all the same."""
    day, now = 86_400, time.time()
    keys = [new_key(gateway, f"thirty-day-{i}") for i in range(9)]  # more than the charts draw: some are "other"
    rows = []
    for i, key_id in enumerate(keys):
        for n in range(20 + 3 * i):  # distinct counts, above any other test's keys: the drawn keys are these
            model = ("family-a-5.5", "family-a-5.4")[n % 2]
            rows.append(LedgerRow(
                id=uuid.uuid4().hex, at_ms=int((now - (n % 25) * day - 600) * 1000), request_id=uuid.uuid4().hex,
                key_id=key_id, env="", endpoint=Endpoint.CHAT.value, model=model, upstream=model, status=200, code="",
                input_tokens=10 + n, output_tokens=n, cached_input_tokens=0, images=0, cost_micros=1_000 * i + n,
                upstream_attempts=1, latency_ms=30, first_token_ms=None))
    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
        db.executemany(insert_sql("?"), [values_of(row) for row in rows])
    asked = []
    tab.page.on("request", lambda request: asked.append(request.url))
    tab.sign_in(admin_secret)
    show(tab, "period=30d&group=api_key_id&bucket=day", "key", "day")
    expect(tab.page.get_by_role("region", name="Spend by key and model", exact=False).locator("tbody tr").first
           ).to_be_visible()

    start = (int(now) // day - 29) * day
    for url in asked:
        query = parse_qs(urlsplit(url).query)
        if "/v1/organization/" not in url or query.get("bucket_width") == ["all"]:
            continue
        assert {"api_key_id", "model"} - set(query.get("group_by", [])), url  # never every day by key and model
        if query.get("group_by"):
            assert 1 <= len(query["api_key_ids"]) <= 6, url  # only the keys drawn, each day

    with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
        text_endpoint = f"endpoint IN {TEXT_ENDPOINTS!r}"  # what the usage API counts as requests and tokens
        where = f"at_ms >= ? AND {text_endpoint}"
        text = db.execute(f"SELECT COUNT(*), SUM(input_tokens), SUM(output_tokens) FROM usage_ledger WHERE {where}",
                          (start * 1000,)).fetchone()
        cost = db.execute("SELECT SUM(cost_micros) FROM usage_ledger WHERE at_ms >= ?", (start * 1000,)).fetchone()[0]
        pairs = {(k, m): (n, i, o, c) for k, m, n, i, o, c in db.execute(
            "SELECT key_id, model, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cost_micros) "
            f"FROM usage_ledger WHERE {where} GROUP BY key_id, model", (start * 1000,))}
        daily = {column: {(k, d): (n, c) for k, d, n, c in db.execute(
            f"SELECT {column}, (at_ms / 1000 - ?) / 86400, SUM({text_endpoint}), SUM(cost_micros) "
            "FROM usage_ledger WHERE at_ms >= ? GROUP BY 1, 2", (start, start * 1000))}
            for column in ("key_id", "model")}
    for label, value in (("Requests", text[0]), ("Input tokens", text[1]), ("Output tokens", text[2])):
        expect(card(tab, label)).to_have_text(f"{value:,}")
    expect(card(tab, "Cost")).to_have_text(usd(cost))
    spend = tab.page.get_by_role("region", name="Spend by key and model, Last 30 days", exact=False)
    for (key_id, model), (n, i, o, c) in pairs.items():
        if key_id in keys:
            expect(spend.get_by_role("row", name=f"({key_id}) {model}").get_by_role("cell")).to_have_text(
                [model, f"{n:,}", f"{i:,}", f"{o:,}", usd(c)])

    # Each day of the requests and cost charts: by key, the six keys with the most requests and "other"; by model (as
    # few as seven), every model.
    for group, column in (("key", "key_id"), ("model", "model")):
        if group == "model":
            show(tab, "period=30d&group=model&bucket=day", "model", "day")
        by_day = daily[column]
        groups = {g for g, _ in by_day}
        ranked = sorted(groups, key=lambda g: -sum(n for (each, _), (n, _) in by_day.items() if each == g))
        for chart, value, shown in (("#chart-requests", 0, lambda n: f"{n:,}"), ("#chart-cost", 1, usd)):
            tab.page.locator(chart).get_by_text("Show the numbers").click()
            figure = tab.page.locator(chart).locator("details table")  # not uPlot's legend
            headers = figure.locator("thead th").all_inner_texts()[1:]
            if group == "key":
                assert headers[-1] == "other" and len(headers) == 7, headers
                drawn = [re.search(r"\((\w+)\)$", label)[1] for label in headers[:-1]]
                assert drawn == ranked[:6]  # the keys with the most requests, most first
            else:
                drawn = headers
                assert set(drawn) == {g for g in groups if value or sum(
                    n for (each, _), (n, _) in by_day.items() if each == g)}, drawn  # requests: text models only
            for d, tr in enumerate(figure.locator("tbody tr").all()):
                cells = tr.locator("th, td").all_inner_texts()[1:]
                values = {g: by_day.get((g, d), (0, 0))[value] for g in groups}
                rest = [shown(sum(v for g, v in values.items() if g not in drawn))] if group == "key" else []
                assert cells == [shown(values[g]) for g in drawn] + rest, (chart, d, cells)
    assert tab.problems.lines == []
