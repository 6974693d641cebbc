"""The admin console in a real browser (Debian chromium + Playwright) against a real `portico serve`.

Every page is saved as a screenshot under the test's temporary directory (tmp_path), desktop and phone width.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from playwright.sync_api import expect

import server
from gateway.envoy import free_ports

from tests.e2e.browser import DESKTOP, PHONE, Tab, api
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The default catalog, but family-a-5.4 has two deployments (the embedded model, and an upstream that nothing
    listens for), so the models page has deployments and their health to show. No request goes to that model."""
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    entry = next(m for m in config["models"] if m["id"] == "family-a-5.4")
    entry["deployments"] = [
        {"name": "local", "weight": 3, "provider": entry.pop("provider")},
        {"name": "mirror", "provider": {"kind": "openai", "base_url": f"http://127.0.0.1:{free_ports(1)[0]}/v1",
                                        "model": "mirror-model"}},
    ]
    path = tmp_path_factory.mktemp("console-config") / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(tmp_path_factory.mktemp("console-data"), "--dev-key", config=path) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_secret(gateway) -> str:
    return gateway.cli("keys", "create", "--name", "ops-admin", "--env", "prod", "--all-models", "--admin") \
        .stdout.split()[-1]


def eventually_status(gateway, secret: str, status: int) -> int:
    """The key cache (keys.cache_seconds, 1 s) bounds how long a change takes to reach requests."""
    deadline = time.monotonic() + 5
    while (got := api(gateway, secret, "GET", "/v1/models").status_code) != status and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_files_come_from_the_gateway_with_a_strict_policy(gateway):
    page = httpx.get(f"{gateway.base_url}/console/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for path in re.findall(r'(?:src|href)="(/console/[^"]+)"', page.text):
        assert httpx.get(f"{gateway.base_url}{path}", timeout=10).status_code == 200, path
    assert "http" not in re.sub(r"https?://(127\.0\.0\.1|localhost)", "", page.text)  # nothing from elsewhere
    missing = httpx.get(f"{gateway.base_url}/console/nope.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_only_an_admin_key_gets_in_and_it_stays_in_the_tab(tab, gateway, admin_secret):
    tab.open()
    alert = tab.page.get_by_role("alert")
    tab.page.get_by_label("Admin key").fill("pk-not-a-real-key")
    tab.page.get_by_role("button", name="Sign in").click()
    expect(alert).to_contain_text("not valid")
    tab.page.get_by_label("Admin key").fill(gateway.secret)  # the development key: valid, but not an admin key
    tab.page.get_by_role("button", name="Sign in").click()
    expect(alert).to_contain_text("not an admin key")
    expect(tab.page.get_by_role("navigation")).to_be_hidden()
    tab.shot("sign-in-refused")

    tab.page.get_by_label("Admin key").fill(admin_secret)
    tab.page.get_by_role("button", name="Sign in").click()
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    expect(tab.page.get_by_role("navigation")).to_be_visible()
    # Kept in the tab's memory only: no storage, no cookie, not in the URL; a reload signs out.
    assert tab.page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert tab.context.cookies() == [] and admin_secret not in tab.page.url
    tab.page.reload()
    expect(tab.page.get_by_label("Admin key")).to_be_visible()
    # The refusals above are the browser's expected "failed to load" lines; nothing else may complain.
    assert [line for line in tab.problems.lines if "status of 40" not in line] == []


def test_create_a_key_read_its_secret_once_and_revoke_it(tab, gateway, admin_secret):
    tab.sign_in(admin_secret)
    page = tab.page
    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("console-made")
    dialog.get_by_label("Environment").fill("staging")
    dialog.get_by_label("Only these models").check()
    dialog.get_by_label("family-a-5.5").check()
    dialog.get_by_label("Requests per minute").fill("30")
    dialog.get_by_label("Budget per day (USD, UTC)").fill("5.25")
    tab.shot("key-create-form")
    dialog.get_by_role("button", name="Create key").click()

    secret_box = page.get_by_role("dialog").get_by_label("Secret")
    expect(secret_box).to_have_value(re.compile(r"^pk-"))
    secret = secret_box.input_value()
    page.get_by_role("button", name="Copy").click()
    expect(page.get_by_role("dialog")).to_contain_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    tab.shot("key-secret-once")
    page.get_by_role("button", name="Done").click()

    expect(page.get_by_role("heading", name="console-made", level=1)).to_be_visible()
    assert secret not in page.content()  # shown once: gone with the dialog
    models = api(gateway, secret, "GET", "/v1/models")
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["family-a-5.5"]
    key_id = page.locator("dd code").first.inner_text()
    key = api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]
    assert key["env"] == "staging" and key["limits"]["requests_per_minute"] == 30 and not key["admin"]
    assert key["limits"]["max_spend_day"] == 5.25
    budget = page.get_by_role("region", name="What the key has used").get_by_role(
        "row", name=re.compile("^Budget per day"))
    expect(budget).to_contain_text("$0.00 of $5.25")
    tab.shot("key-page")

    # The same audit trail as any admin call: the access log names the signed-in admin key, never a secret.
    admin_id = next(k["id"] for k in api(gateway, admin_secret, "GET", "/v1/admin/keys").json()["keys"]
                    if k["name"] == "ops-admin")
    logged = [json.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line["rpc"] == "KeyService/CreateKeyHttp" and line["key_id"] == admin_id and line["status"] == 200
               for line in logged)

    page.get_by_role("button", name="Revoke").click()
    confirm = page.get_by_role("dialog")
    expect(confirm).to_contain_text(key_id)
    tab.shot("key-revoke-confirm")
    confirm.get_by_role("button", name="Revoke key").click()
    expect(page.get_by_text("✕ revoked")).to_be_visible()
    assert eventually_status(gateway, secret, 401) == 401  # the gateway refuses it now
    tab.shot("key-revoked")
    assert tab.problems.lines == []


def test_filter_edit_and_rotate(tab, gateway, admin_secret):
    made = gateway.cli("keys", "create", "--name", "search-indexer", "--env", "search", "--all-models").stdout
    key_id, old_secret = made.split()[2], made.split()[-1]
    gone = gateway.cli("keys", "create", "--name", "old-batch", "--env", "search", "--all-models").stdout.split()[2]
    gateway.cli("keys", "revoke", gone)
    tab.sign_in(admin_secret)
    page = tab.page
    page.get_by_label("Environment").select_option("search")
    rows = page.locator("tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("search-indexer")
    page.get_by_label("State").select_option("revoked")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("old-batch")
    assert "env=search" in page.url and "state=revoked" in page.url
    tab.shot("keys-filtered")

    tab.open(f"#/keys/{key_id}")
    page.get_by_role("button", name="Edit").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("search-indexer-eu")  # the confirmation names the key as it is now
    dialog.get_by_label("Requests per minute").fill("45")
    dialog.get_by_label("Only these models").check()
    dialog.get_by_label("family-a-5.4").check()
    dialog.get_by_role("button", name="Save").click()
    expect(page.get_by_role("status")).to_have_text("Saved key search-indexer-eu.")
    expect(page.locator("dl.limits")).to_contain_text("Requests per minute45")
    key = api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]
    assert key["limits"]["requests_per_minute"] == 45 and key["models"] == ["family-a-5.4"] and not key["all_models"]

    page.get_by_role("button", name="Rotate secret").click()
    page.get_by_role("dialog").get_by_label("Grace period in seconds").fill("0")
    page.get_by_role("dialog").get_by_role("button", name="Rotate").click()
    new_secret = page.get_by_role("dialog").get_by_label("Secret").input_value()
    assert new_secret.startswith("pk-") and new_secret != old_secret
    tab.shot("key-rotated")
    page.get_by_role("button", name="Done").click()
    assert eventually_status(gateway, old_secret, 401) == 401
    assert api(gateway, new_secret, "GET", "/v1/models").status_code == 200
    assert tab.problems.lines == []


def test_a_typo_in_a_number_field_is_an_error_and_nothing_is_sent(tab, gateway, admin_secret):
    """A type=number field reads "" for text it cannot parse (100e), which used to save as "no limit"."""
    made = gateway.cli("keys", "create", "--name", "badinput", "--all-models", "--rpm", "100").stdout
    key_id = made.split()[2]
    tab.sign_in(admin_secret)
    page = tab.page
    changes = []  # every request the page sends that is not a read
    page.on("request", lambda request: request.method != "GET" and changes.append(request.url))

    tab.open(f"#/keys/{key_id}")
    page.get_by_role("button", name="Edit").click()
    dialog = page.get_by_role("dialog")
    for label, typed, error in (("Requests per minute", "e", "whole number"),
                                ("Budget per day (USD, UTC)", "1,5", "no commas")):
        box = dialog.get_by_label(label)
        box.press("End")
        box.press_sequentially(typed)
        dialog.get_by_role("button", name="Save").click()
        field = dialog.locator(".field").filter(has=page.get_by_label(label))
        expect(field.get_by_role("alert")).to_contain_text(f"{label} must be")
        expect(field.get_by_role("alert")).to_contain_text(error)
        expect(box).to_be_focused()
        expect(box).to_have_attribute("aria-invalid", "true")
        box.fill("")
    expect(dialog.get_by_label("Requests per minute")).to_have_value("")
    tab.shot("key-edit-typo")
    dialog.get_by_role("button", name="Cancel").click()
    key = api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]
    assert key["limits"]["requests_per_minute"] == 100 and "max_spend_day" not in key["limits"]

    page.get_by_role("button", name="Rotate secret").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Grace period in seconds").press_sequentially("0e")
    dialog.get_by_role("button", name="Rotate").click()
    expect(dialog.get_by_role("alert")).to_contain_text("The grace period (seconds) must be a whole number")
    dialog.get_by_role("button", name="Cancel").click()

    page.get_by_role("navigation").get_by_role("link", name="Keys").click()
    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("typo-made")
    dialog.get_by_label("Requests per minute").press_sequentially("5e")
    dialog.get_by_role("button", name="Create key").click()
    expect(dialog.get_by_role("alert")).to_contain_text("Requests per minute must be a whole number")
    dialog.get_by_role("button", name="Cancel").click()
    keys = api(gateway, admin_secret, "GET", "/v1/admin/keys").json()["keys"]
    assert "typo-made" not in [k["name"] for k in keys]
    assert changes == []  # no update, rotation or creation was sent
    assert tab.problems.lines == []


def test_phone_width_and_keyboard_only(browser, gateway, admin_secret, tmp_path):
    tab = Tab(browser, gateway, tmp_path, viewport=PHONE)
    try:
        tab.open()
        page = tab.page
        tab.shot("phone-sign-in")
        page.keyboard.press("Tab")  # from the page's heading to the key field
        page.keyboard.type(admin_secret)
        page.keyboard.press("Enter")
        expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
        tab.no_horizontal_scroll()  # a wide table scrolls inside its own box, not the page
        tab.shot("phone-keys")
        # Keyboard only: Tab reaches "Create key", Enter opens the form, Escape closes it.
        for _ in range(12):
            page.keyboard.press("Tab")
            if page.evaluate("document.activeElement.textContent") == "Create key":
                break
        page.keyboard.press("Enter")
        expect(page.get_by_role("dialog")).to_be_visible()
        expect(page.get_by_role("dialog").get_by_label("Name")).to_be_focused()
        tab.no_horizontal_scroll()
        tab.shot("phone-create-key")
        page.keyboard.press("Escape")
        expect(page.get_by_role("dialog")).to_have_count(0)
        assert tab.problems.lines == []
    finally:
        tab.context.close()


def test_a_keyboard_user_steps_through_a_filters_choices(tab, gateway, admin_secret):
    """Arrow keys on the Environment filter applied the first step and moved the focus to the page's heading: the next
    arrow scrolled the page, and every further choice took a Tab back. The filter keeps the focus."""
    for env in ("kbd-a", "kbd-b"):
        gateway.cli("keys", "create", "--name", f"stepper-{env}", "--env", env, "--all-models")
    tab.sign_in(admin_secret)
    page = tab.page
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    envs = page.get_by_label("Environment")
    choices = envs.locator("option").evaluate_all("options => options.map((option) => option.value)")
    envs.focus()
    for step in (1, 2):
        page.keyboard.press("ArrowDown")
        expect(page).to_have_url(re.compile(f"#/keys\\?env={re.escape(choices[step])}$"))
        expect(page.locator(".count")).to_be_visible()
        expect(page.get_by_label("Environment")).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.get_by_label("State")).to_be_focused()
    page.keyboard.press("ArrowDown")  # State: from active to revoked
    expect(page).to_have_url(re.compile("state=revoked"))
    expect(page.get_by_label("State")).to_be_focused()
    assert tab.problems.lines == []


def test_a_keyboard_user_who_tabs_on_before_the_list_arrives_stays_where_they_went(tab, gateway, admin_secret):
    """The list of a filter's choice arrived and moved the focus back to that filter, even though the user had
    tabbed on to the next one meanwhile (CI, a busy machine): their next arrow key changed the wrong filter."""
    gateway.cli("keys", "create", "--name", "early-tabber", "--env", "kbd-late", "--all-models")
    tab.sign_in(admin_secret)
    page = tab.page
    expect(page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    held = []
    page.route("**/v1/admin/keys", lambda route: held.append(route))  # answered only when the test lets it
    page.get_by_label("Environment").focus()
    page.keyboard.press("ArrowDown")
    expect(page).to_have_url(re.compile(r"#/keys\?env="))
    for _ in range(250):
        if held:
            break
        page.wait_for_timeout(20)
    assert held, "the list was not asked for"
    page.keyboard.press("Tab")
    expect(page.get_by_label("State")).to_be_focused()
    for route in held:
        route.continue_()
    page.unroute("**/v1/admin/keys")
    expect(page.locator("#main")).not_to_have_attribute("aria-busy", "true")
    expect(page.get_by_label("State")).to_be_focused()
    page.keyboard.press("ArrowDown")
    expect(page).to_have_url(re.compile("state=revoked"))
    assert tab.problems.lines == []


def test_a_keys_page_shows_what_is_left_of_its_limits_now(tab, gateway, admin_secret):
    made = gateway.cli("keys", "create", "--name", "metered", "--all-models", "--rpm", "20", "--daily-requests",
                       "500").stdout
    key_id, secret = made.split()[2], made.split()[-1]
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for _ in range(2):
        assert api(gateway, secret, "POST", "/v1/chat/completions", json=chat).status_code == 200
    refused = api(gateway, gateway.secret, "GET", f"/v1/admin/keys/{key_id}/limits")  # not an admin key
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert "KeyService" not in refused.json()["error"]["message"]  # it names what the caller called

    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{key_id}")
    left = tab.page.get_by_role("region", name="What the key has used")
    rpm = left.get_by_role("row", name=re.compile("^Requests per minute all its models"))
    expect(rpm).to_contain_text("2 of 20")
    expect(rpm.get_by_role("cell").nth(2)).to_have_text("18")  # the row header is not a cell
    expect(left.get_by_role("row", name=re.compile("^Requests per day"))).to_contain_text("2 of 500")
    # Its use of each model this week, from the usage ledger (rows reach it within usage.flush_seconds).
    tab.page.wait_for_timeout(1200)
    tab.page.reload()
    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{key_id}")
    week = tab.page.get_by_role("region", name="The key's use of each model, last 7 days")
    expect(week.get_by_role("row", name=re.compile("^family-a-5.5"))).to_contain_text("2")
    expect(tab.page.locator("#chart-key-requests canvas")).to_have_count(1)
    recent = tab.page.get_by_role("region", name=re.compile("^The key's last .* requests"))
    expect(recent.locator("tbody tr")).to_have_count(2)
    expect(recent.locator("tbody tr").first).to_contain_text("200 ok")
    tab.shot("key-limits-left")
    assert tab.problems.lines == []


def test_the_usage_page_reflects_requests_just_made(tab, gateway, admin_secret):
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    made = {}
    for name, count in (("usage-alpha", 3), ("usage-beta", 1)):
        out = gateway.cli("keys", "create", "--name", name, "--env", "analytics", "--all-models").stdout
        made[name] = (out.split()[2], out.split()[-1])
        for _ in range(count):
            assert api(gateway, made[name][1], "POST", "/v1/chat/completions", json=chat).status_code == 200
    time.sleep(1.5)  # usage.flush_seconds: rows reach the ledger within a second

    tab.sign_in(admin_secret)
    tab.page.get_by_role("navigation").get_by_role("link", name="Usage").click()
    expect(tab.page.get_by_role("heading", name="Usage", level=1)).to_be_visible()
    page = tab.page
    page.get_by_label("Period", exact=True).select_option("24h")
    page.get_by_label("By", exact=True).select_option("api_key_id")
    page.get_by_label("Per", exact=True).select_option("hour")
    page.get_by_role("button", name="Show").click()
    chart = page.locator("#chart-requests")
    expect(chart.get_by_role("img")).to_be_visible()
    expect(chart.locator("canvas")).to_have_count(1)  # drawn by uPlot
    alpha, beta = (f"{name} ({made[name][0]})" for name in ("usage-alpha", "usage-beta"))
    expect(chart.locator(".u-legend")).to_contain_text(alpha)
    # A legend entry hides and shows its series: by mouse only, until it took the keyboard's Tab and Enter or Space.
    entry = chart.get_by_role("button", name=alpha)
    expect(entry).to_have_attribute("aria-pressed", "true")
    entry.focus()
    page.keyboard.press("Enter")
    expect(entry).to_have_attribute("aria-pressed", "false")
    expect(chart.locator(".u-legend tr.u-off")).to_contain_text(alpha)
    page.keyboard.press(" ")
    expect(entry).to_have_attribute("aria-pressed", "true")
    expect(chart.locator(".u-legend tr.u-off")).to_have_count(0)
    chart.get_by_text("Show the numbers").click()
    numbers = chart.get_by_role("table")
    headers = numbers.locator("thead th").all_inner_texts()
    now_row = numbers.locator("tbody tr").last.locator("th, td").all_inner_texts()  # the current hour
    assert now_row[headers.index(alpha)] == "3" and now_row[headers.index(beta)] == "1"
    totals = page.get_by_role("list", name=re.compile("^Totals"))
    # Several hours: no percentile of the period (test_console_usage.py), the latency per hour in its chart.
    expect(totals.get_by_role("listitem").filter(has_text="Latency p95")).to_contain_text("per hour, below")
    expect(page.locator("#chart-latency canvas")).to_have_count(1)
    spend = page.get_by_role("region", name=re.compile("^Spend by key and model"))
    expect(spend.get_by_role("row", name=re.compile(f"^{re.escape(alpha)} family-a-5.5"))).to_contain_text(" 3 ")
    tab.shot("usage")
    # Chosen UTC days (today only) and the default "this week" both count them too.
    today = time.strftime("%Y-%m-%d", time.gmtime())
    page.get_by_label("Period", exact=True).select_option("custom")
    page.get_by_label("From (UTC)").fill(today)
    page.get_by_label("To (UTC)").fill(today)
    page.get_by_role("button", name="Show").click()
    expect(page.get_by_role("region", name=f"Spend by key and model, {today} to {today}")
           .get_by_role("row", name=re.compile(f"^{re.escape(alpha)} family-a-5.5"))).to_contain_text(" 3 ")
    page.get_by_label("Period", exact=True).select_option("week")
    page.get_by_role("button", name="Show").click()
    expect(page.get_by_role("region", name=re.compile("^Spend by key and model, This week"))
           .get_by_role("row", name=re.compile(f"^{re.escape(beta)} family-a-5.5"))).to_contain_text(" 1 ")
    tab.page.set_viewport_size(PHONE)
    tab.no_horizontal_scroll()
    tab.shot("usage-phone")

    # The models page: the whole catalog (admin only), with each model's requests this week.
    assert api(gateway, gateway.secret, "GET", "/v1/admin/models").status_code == 403
    tab.page.set_viewport_size(DESKTOP)
    page.get_by_role("navigation").get_by_role("link", name="Models").click()
    catalog = page.get_by_role("region", name="The model catalog")
    expect(catalog.locator("tbody tr")).to_have_count(8)
    row = catalog.get_by_role("row", name=re.compile("^family-a-5.5 "))
    expect(row).to_contain_text("/v1/chat/completions")
    expect(row).to_contain_text("embedded model")
    mirrored = catalog.get_by_role("row", name=re.compile("^family-a-5.4 "))
    expect(mirrored.get_by_role("listitem")).to_have_text([
        re.compile(r"^local \(75 %\): embedded model .* — ● healthy$"),
        re.compile(r"^mirror \(25 %\): OpenAI-compatible upstream as mirror-model — ● healthy$")])
    headers = catalog.locator("thead th").all_inner_texts()
    assert int(row.locator("th, td").nth(headers.index("Requests")).inner_text().replace(",", "")) >= 4
    tab.shot("models")
    assert tab.problems.lines == []
