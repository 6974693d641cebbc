"""The admin console in a real browser, given what a person may type or paste: every mistake gets a clear message
where it was made, nothing is sent that the gateway would refuse, and no page fails with a script error.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml
from playwright.sync_api import expect

from tests.e2e.browser import PHONE, Tab, api, new_admin_secret
import server
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("console-input-data"), "--dev-key") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_secret(gateway) -> str:
    return new_admin_secret(gateway)


def failed_loads_aside(lines: list[str]) -> list[str]:
    """A refused API call is logged by the browser as a failed load; anything else is a fault of the page."""
    return [line for line in lines if "the server responded with a status of 4" not in line]


def test_a_pasted_key_that_cannot_be_one_and_a_mistyped_url(tab, gateway, admin_secret):
    tab.open()
    alert = tab.page.get_by_role("alert")
    tab.page.get_by_label("Admin key").fill("pk-prod-“quoted”")  # a word processor's quotes: not ASCII
    tab.page.get_by_role("button", name="Sign in").click()
    expect(alert).to_have_text("That key is not valid: it is unknown, mistyped or revoked.")

    made = gateway.cli("keys", "create", "--name", "batch", "--env", "search", "--all-models").stdout.split()[2]
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    tab.page.goto("/console/#/keys/50%ZZ")  # a stray "%": the page says so, it does not stop
    expect(tab.page.get_by_role("heading", name="Something went wrong", level=1)).to_be_visible()
    expect(tab.page.get_by_role("alert")).to_have_text("No key with id '50%ZZ'.")

    # A bookmarked filter shows as it filters: an environment no key has now, and an unknown state (read as active).
    tab.page.goto("/console/#/keys?env=retired&state=bogus")
    expect(tab.page.locator("p.count")).to_have_text(re.compile(r"^0 of \d+ keys?$"))
    expect(tab.page.get_by_label("Environment")).to_have_value("retired")
    # One longer than any environment can be (a link cut and pasted together) made the page 4,000 px wide.
    tab.page.goto(f"/console/#/keys?env={'z' * 500}")
    expect(tab.page.get_by_label("Environment")).to_have_value("z" * 500)
    tab.no_horizontal_scroll()
    tab.page.goto("/console/#/keys?state=bogus")
    expect(tab.page.get_by_label("State")).to_have_value("active")
    expect(tab.page.get_by_role("row", name=re.compile("^batch "))).to_contain_text(made)

    # A secret pasted as a search would go into the URL, and so the browser's history: refused, and cleared.
    search = tab.page.get_by_label("Name or id")
    search.fill(admin_secret)
    search.press("Enter")
    expect(tab.page.get_by_role("search").get_by_role("alert")).to_contain_text("That is a key's secret")
    expect(search).to_have_value("")
    assert admin_secret not in tab.page.url and admin_secret not in tab.page.content()
    tab.shot("keys-search-secret")
    assert failed_loads_aside(tab.problems.lines) == []


def test_values_the_gateway_refuses_are_told_at_their_field(tab, gateway, admin_secret):
    key_id = gateway.cli("keys", "create", "--name", "rotating", "--all-models").stdout.split()[2]
    tab.sign_in(admin_secret)
    page = tab.page
    sent = []
    page.on("request", lambda request: request.method != "GET" and sent.append(request.url))

    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("too-rich")
    budget = dialog.get_by_label("Budget per month (USD, UTC)")
    budget.fill("1000000000.01")  # over the gateway's largest budget: refused before sending
    dialog.get_by_role("button", name="Create key").click()
    expect(dialog.locator(".field").filter(has=page.get_by_label("Budget per month (USD, UTC)")).get_by_role("alert")).to_contain_text("at most 1000000000")
    assert sent == []
    budget.fill("")
    env = dialog.get_by_label("Environment")
    env.fill("eu west")  # the gateway's 400 (param "env") is shown under that field
    dialog.get_by_role("button", name="Create key").click()
    expect(dialog.locator(".field").filter(has=page.get_by_label("Environment")).get_by_role("alert")).to_contain_text("env must be")
    expect(env).to_be_focused()
    expect(env).to_have_attribute("aria-invalid", "true")
    dialog.get_by_role("button", name="Cancel").click()

    tab.open(f"#/keys/{key_id}")
    sent.clear()
    page.get_by_role("button", name="Rotate secret").click()
    dialog = page.get_by_role("dialog")
    grace = dialog.get_by_label("Grace period in seconds")
    grace.fill("315360001")  # more than ten years: the gateway would refuse it
    dialog.get_by_role("button", name="Rotate").click()
    expect(dialog.get_by_role("alert")).to_contain_text("from 0 to 315360000")
    assert sent == []
    grace.fill("0")
    dialog.get_by_role("button", name="Rotate").click()
    secret_dialog = page.get_by_role("dialog", name=re.compile("^New secret"))
    expect(secret_dialog).to_contain_text("The previous secret stops working within seconds.")
    secret_dialog.get_by_role("button", name="Done").click()
    assert failed_loads_aside(tab.problems.lines) == []


def test_chosen_days_that_make_no_period_are_refused(tab, gateway, admin_secret):
    tab.sign_in(admin_secret)
    page = tab.page
    page.get_by_role("navigation").get_by_role("link", name="Usage").click()
    expect(page.locator(".window")).to_be_visible()
    page.get_by_label("Period", exact=True).select_option("custom")
    page.get_by_label("From (UTC)").fill("2026-11-20")
    page.get_by_label("To (UTC)").fill("2026-11-10")
    page.get_by_role("button", name="Show").click()
    expect(page.locator(".dates").get_by_role("alert")).to_contain_text("From on or before To")
    expect(page.get_by_label("To (UTC)")).to_be_focused()
    assert "from=" not in page.url  # not shown as some other period
    assert tab.problems.lines == []


def test_a_revocation_that_fails_says_so(tab, gateway, admin_secret):
    made = gateway.cli("keys", "create", "--name", "short-lived-admin", "--all-models", "--admin").stdout.split()
    admin_id, short_lived = made[2], made[-1]
    target = gateway.cli("keys", "create", "--name", "target", "--all-models").stdout.split()[2]
    tab.sign_in(short_lived)
    tab.open(f"#/keys/{target}")
    gateway.cli("keys", "revoke", admin_id)  # the signed-in key is revoked meanwhile
    tab.page.wait_for_timeout(1500)  # keys.cache_seconds
    tab.page.get_by_role("button", name="Revoke").click()
    tab.page.get_by_role("dialog").get_by_role("button", name="Revoke key").click()
    expect(tab.page.get_by_role("status").first).to_contain_text("Could not revoke key target")
    expect(tab.page.get_by_role("status").first).to_contain_text("no longer valid")  # not "Incorrect API key"
    expect(tab.page.get_by_label("Admin key")).to_be_visible()  # signed out, not left with a dead key
    assert api(gateway, admin_secret, "GET", f"/v1/admin/keys/{target}").json()["key"]["revoked_at"] == 0
    assert failed_loads_aside(tab.problems.lines) == []


def test_a_keys_errors_are_a_share_of_what_it_sent(tab, gateway, admin_secret):
    """One request answered, one refused by the key's limit: "1 request, 1 error" would read as the answered one
    failing; the key's week says 2 requests, 50 % of them failed."""
    made = gateway.cli("keys", "create", "--name", "one-a-minute", "--all-models", "--rpm", "1").stdout.split()
    key_id, secret = made[2], made[-1]
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert [api(gateway, secret, "POST", "/v1/chat/completions", json=chat).status_code for _ in range(2)] == [200, 429]
    tab.page.wait_for_timeout(1500)  # usage.flush_seconds
    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{key_id}")
    week = tab.page.get_by_role("region", name="The key's use of each model, last 7 days")
    expect(week.get_by_role("row", name=re.compile("^family-a-5.5")).get_by_role("cell")).to_have_text(
        ["2", "50.0 % (1)", re.compile(r"^\d+$"), "1", "$0.00"])  # the row header is not a cell
    assert failed_loads_aside(tab.problems.lines) == []


def test_a_long_name_without_a_space_wraps(tab, gateway, admin_secret):
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": "n" * 200, "all_models": True})
    key_id = made.json()["key"]["id"]
    tab.sign_in(admin_secret)
    tab.page.set_viewport_size(PHONE)
    tab.open(f"#/keys/{key_id}")
    expect(tab.page.get_by_role("heading", name="n" * 200, level=1)).to_be_visible()
    tab.no_horizontal_scroll()
    tab.page.get_by_role("button", name="Revoke").click()
    dialog = tab.page.get_by_role("dialog")
    assert dialog.evaluate("box => box.scrollWidth <= box.clientWidth")
    tab.shot("long-name-phone")
    dialog.get_by_role("button", name="Cancel").click()
    assert tab.problems.lines == []


def test_a_link_whose_days_make_no_period_says_so(tab, gateway, admin_secret):
    """A bookmarked or edited link (To before From, a day to come, no date) was shown as this week without a word: the
    figures read as the days the link names."""
    tab.sign_in(admin_secret)
    for query in ("from=2026-11-20&to=2026-11-10", "from=2999-01-01&to=2999-01-02", "from=2026-11-31&to=yesterday"):
        tab.open(f"#/usage?{query}")
        expect(tab.page.locator(".window")).to_contain_text("per")
        alert = tab.page.locator("main").get_by_role("alert").filter(has_text="make no period")
        expect(alert).to_contain_text("This week (since Monday, UTC) is shown instead")
    tab.open("#/usage?period=7d")  # a link without days is no mistake
    expect(tab.page.locator("main").get_by_role("alert").filter(has_text="make no period")).to_have_count(0)
    assert tab.problems.lines == []


def test_a_long_name_leaves_every_table_readable_at_desktop_width(tab, gateway, admin_secret):
    """A 200-character name without a space once made the keys table ~2,900 px wide at 1280 px, every row of 100+
    keys some 100 px tall and the Id and State columns out of sight; the models table hid its Cost column."""
    long_name = "w" * 200
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": long_name, "all_models": True})
    secret = made.json()["secret"]
    chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert api(gateway, secret, "POST", "/v1/chat/completions", json=chat).status_code == 200
    for n in range(12):
        api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": f"many-{n:02d}", "all_models": True})
    fits = "table => table.parentElement.scrollWidth <= table.parentElement.clientWidth"
    tab.sign_in(admin_secret)
    keys = tab.page.get_by_role("region", name="API keys")
    expect(keys.get_by_role("link", name=long_name)).to_be_visible()
    assert keys.locator("table").evaluate(fits)
    short_row = keys.get_by_role("row", name=re.compile("^many-00"))
    assert short_row.bounding_box()["height"] < 60  # one line, or two where a date wraps
    tab.shot("long-name-keys")
    for hash_, region in (("#/usage?period=24h", "Spend by key and model"), ("#/models", "The model catalog")):
        tab.open(hash_)
        table = tab.page.get_by_role("region", name=re.compile(f"^{region}")).locator("table")
        assert table.evaluate(fits), hash_
    tab.shot("long-name-models")
    assert tab.problems.lines == []


def test_keys_made_in_the_same_second_are_listed_by_name(tab, gateway, admin_secret):
    """Keys made by a script share their creation second: they were listed in the API's order (random ids), so
    batch-07 came after batch-11 and before batch-02."""
    names = [f"batch-{n:02d}" for n in range(12)]
    for name in names:
        api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": name, "env": "batch", "all_models": True})
    tab.sign_in(admin_secret)
    tab.open("#/keys?env=batch")
    links = tab.page.get_by_role("region", name="API keys").get_by_role("link")
    expect(links).to_have_count(12)
    created = {key["name"]: key["created"] for key in api(gateway, admin_secret, "GET", "/v1/admin/keys").json()["keys"]}
    newest_first = sorted(names, key=lambda name: (-created[name], name))
    assert links.all_inner_texts() == newest_first


def test_a_message_stays_with_the_page_it_was_about(tab, gateway, admin_secret):
    """"Revoked key old-one." stayed above every page visited afterwards, another key's page too, as if that key
    were the one revoked ("Signed in." likewise stayed for the whole session)."""
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": "old-one", "all_models": True})
    other = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": "still-here", "all_models": True})
    tab.sign_in(admin_secret)
    status = tab.page.get_by_role("status").first
    expect(status).to_have_text("Signed in.")
    tab.open(f"#/keys/{made.json()['key']['id']}")
    expect(status).to_have_text("")
    tab.page.get_by_role("button", name="Revoke").click()
    tab.page.get_by_role("dialog").get_by_role("button", name="Revoke key").click()
    expect(status).to_have_text("Revoked key old-one.")
    tab.open(f"#/keys/{other.json()['key']['id']}")
    expect(tab.page.get_by_role("heading", name="still-here", level=1)).to_be_visible()
    expect(status).to_have_text("")


def test_no_model_chosen_is_told_at_the_models(tab, gateway, admin_secret):
    """"Choose at least one model" was shown under the form's last field, by its buttons, with the focus left on
    Create key: a keyboard or screen reader user was not taken to the models to choose."""
    tab.sign_in(admin_secret)
    page = tab.page
    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("no-models")
    dialog.get_by_label("Only these models").check()
    dialog.get_by_role("button", name="Create key").click()
    models = dialog.get_by_role("group", name="Models")
    expect(models.get_by_role("alert")).to_have_text("Choose at least one model, or all models.")
    expect(models.get_by_role("checkbox").first).to_be_focused()
    expect(models.get_by_role("checkbox").first).to_have_attribute("aria-invalid", "true")
    # The gateway's 400 about grants (a model gone from the catalog since the form opened) is shown there too.
    unknown = {"error": {"message": "Unknown model(s): 'family-a-5.4'.", "type": "invalid_request_error",
                         "param": "models", "code": "invalid_request"}}
    page.route("**/v1/admin/keys", lambda route: route.fulfill(status=400, json=unknown)
               if route.request.method == "POST" else route.fallback())
    models.get_by_role("checkbox", name="family-a-5.4").check()
    dialog.get_by_role("button", name="Create key").click()
    expect(models.get_by_role("alert")).to_have_text("Unknown model(s): 'family-a-5.4'.")
    dialog.get_by_role("button", name="Cancel").click()
    assert failed_loads_aside(tab.problems.lines) == []


def test_the_key_form_fits_a_small_phone(tab, gateway, admin_secret):
    """At 320 px (a small phone, or a 390 px one zoomed to 125 %) the models' grid was wider than the dialog: the
    form scrolled sideways and the models' names were cut at its edge."""
    tab.sign_in(admin_secret)
    tab.page.set_viewport_size({"width": 320, "height": 640})
    tab.page.get_by_role("button", name="Create key").click()
    dialog = tab.page.get_by_role("dialog")
    dialog.get_by_label("Only these models").check()
    expect(dialog.get_by_role("checkbox", name="family-a-5.5")).to_be_visible()
    assert dialog.evaluate("box => box.scrollWidth <= box.clientWidth")
    tab.shot("key-form-320")
    dialog.get_by_role("button", name="Cancel").click()
    tab.no_horizontal_scroll()


@pytest.mark.parametrize("hash_, key_id", [("..", ".."), (".", "."), ("%2E%2E", ".."), ("%2e.", ".."),
                                           ("a%2Fb", "a/b"), ("..%2Flimits", "../limits"), ("a%3Fb%23c", "a?b#c")])
def test_a_crafted_key_link_calls_only_that_keys_paths(tab, admin_secret, hash_, key_id):
    """A key id in a link is one path segment: it never reaches another admin path (`..` would make
    /v1/admin/keys/../limits /v1/admin/limits), and an id no URL path can hold is no key."""
    tab.sign_in(admin_secret)
    expect(tab.page.get_by_role("heading", name="Keys", level=1)).to_be_visible()
    paths = []
    tab.page.on("request", lambda request: paths.append(request.url.split("?")[0]))
    tab.page.goto(f"/console/#/keys/{hash_}")
    expect(tab.page.get_by_role("alert")).to_have_text(f"No key with id '{key_id}'.")
    segment = quote(key_id, safe="-_.!~*'()")  # as encodeURIComponent writes it
    allowed = {f"/v1/admin/keys/{segment}", f"/v1/admin/keys/{segment}/limits", "/v1/admin/keys", "/v1/admin/models",
               "/v1/organization/requests", "/v1/organization/usage/completions", "/v1/organization/costs"}
    called = {re.sub(r"^https?://[^/]+", "", url) for url in paths if "/v1/" in url}
    assert called <= allowed, called - allowed


@pytest.mark.parametrize("pasted", ["Bearer {}", "OPENAI_API_KEY={}", '"{}"', "Authorization: Bearer {}"])
def test_a_secret_pasted_with_what_came_around_it_stays_out_of_the_url(tab, admin_secret, pasted):
    """Copied from an Authorization header, a .env file or a quoted string, the secret came with the keys' search
    into the URL, and so into the browser's history."""
    tab.sign_in(admin_secret)
    search = tab.page.get_by_label("Name or id")
    search.fill(pasted.format(admin_secret))
    search.press("Enter")
    expect(tab.page.get_by_role("search").get_by_role("alert")).to_contain_text("That is a key's secret")
    expect(search).to_have_value("")
    assert admin_secret not in tab.page.url and admin_secret not in tab.page.content()


def test_a_name_of_up_to_200_characters_is_taken_whole(tab, gateway, admin_secret):
    """The Name field stopped at 200 UTF-16 units: 150 emoji (150 characters, a name the gateway takes) were cut to
    100 without a word, and a pasted 250-character name was cut to 200 and created so."""
    tab.sign_in(admin_secret)
    page = tab.page
    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    name = dialog.get_by_label("Name")
    name.focus()
    page.keyboard.insert_text("🦊" * 150)  # as a paste is
    expect(name).to_have_value("🦊" * 150)
    dialog.get_by_role("button", name="Create key").click()
    page.get_by_role("dialog", name=re.compile("^Key .* created")).get_by_role("button", name="Done").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("🦊" * 150)

    page.goto("/console/#/keys")
    page.get_by_role("button", name="Create key").click()
    dialog = page.get_by_role("dialog")
    name = dialog.get_by_label("Name")
    name.focus()
    page.keyboard.insert_text("q" * 250)
    dialog.get_by_role("button", name="Create key").click()  # the gateway's 400, at the field: nothing made
    field = dialog.locator(".field").filter(has=page.get_by_label("Name", exact=True))
    expect(field.get_by_role("alert")).to_contain_text("at most 200 characters")
    expect(name).to_have_value("q" * 250)
    keys = api(gateway, admin_secret, "GET", "/v1/admin/keys").json()["keys"]
    assert not [key for key in keys if key["name"].startswith("q" * 200)]


def test_a_long_model_id_or_key_name_leaves_every_choice_and_legend_in_sight(browser, tmp_path):
    """A model id may be 256 characters without a space: the models' group took that width, its grid made a row of
    5,800 px, and every model after the third was past the dialog's right edge. Each chart's legend likewise."""
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    long_id = "m" * 256
    config["models"].append({**config["models"][0], "id": long_id})
    path = tmp_path / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(tmp_path / "data", "--dev-key", config=path) as gateway:
        admin_secret = gateway.cli("keys", "create", "--name", "ops", "--all-models", "--admin").stdout.split()[-1]
        tab = Tab(browser, gateway, tmp_path)
        try:
            tab.sign_in(admin_secret)
            tab.page.get_by_role("button", name="Create key").click()
            dialog = tab.page.get_by_role("dialog")
            dialog.get_by_label("Only these models").check()
            assert dialog.evaluate("box => box.scrollWidth <= box.clientWidth")
            inside = dialog.bounding_box()
            for model in ["family-a-5.5", "family-b-sonnet-4-6", long_id]:
                box = dialog.get_by_role("checkbox", name=model, exact=True).bounding_box()
                assert inside["x"] <= box["x"] and box["x"] + box["width"] <= inside["x"] + inside["width"], model
            tab.shot("key-form-long-model-id")
            dialog.get_by_role("button", name="Cancel").click()

            # The charts' legends: the long one took the chart's width and the others were past its edge, hidden.
            made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": "k" * 200, "all_models": True})
            for model in (long_id, "family-a-5.5"):
                chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                for secret in (admin_secret, made.json()["secret"]):
                    assert api(gateway, secret, "POST", "/v1/chat/completions", json=chat).status_code == 200
            deadline = time.monotonic() + 10  # the ledger is written once a second
            while len(api(gateway, admin_secret, "GET", "/v1/organization/requests").json()["data"]) < 4:
                assert time.monotonic() < deadline, "the ledger did not get the requests"
                time.sleep(0.2)
            for group, word in (("model", "model"), ("api_key_id", "key")):
                tab.open(f"#/usage?period=24h&group={group}")
                expect(tab.page.get_by_role("heading", name=f"Requests by {word}")).to_be_visible()
                expect(tab.page.locator("figure.chart .u-legend")).to_have_count(4)  # all drawn
                for chart in tab.page.locator("figure.chart").all():
                    inside = chart.bounding_box()
                    entries = chart.locator(".u-legend tr")
                    expect(entries.first).to_be_visible()
                    for entry in entries.all():
                        if (box := entry.bounding_box()) is None:
                            continue  # the time series' own entry, which uPlot does not show
                        assert inside["x"] <= box["x"] and box["x"] + box["width"] <= inside["x"] + inside["width"], \
                            (group, entry.inner_text()[:40])
                tab.shot(f"usage-long-{group}")
        finally:
            tab.context.close()


def test_an_error_of_no_field_keeps_the_focus_in_the_form(tab, gateway, admin_secret):
    """The key revoked by someone else while its rotation form was open: the gateway's 400 (param `id`, no field of
    the form) was shown, but the focus was left on the page's body, outside the dialog, since the Rotate button that
    had it was disabled while the request was on its way. Once the form was closed, the page still showed the key
    active."""
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": "revoked-meanwhile", "all_models": True})
    key_id = made.json()["key"]["id"]
    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{key_id}")
    tab.page.get_by_role("button", name="Rotate secret").click()
    dialog = tab.page.get_by_role("dialog")
    assert api(gateway, admin_secret, "POST", f"/v1/admin/keys/{key_id}/revoke").status_code == 200
    rotate = dialog.get_by_role("button", name="Rotate")
    rotate.click()
    expect(dialog.get_by_role("alert")).to_contain_text("a revoked key cannot be rotated")
    expect(rotate).to_be_focused()
    tab.page.keyboard.press("Escape")  # the keyboard still works the dialog
    expect(dialog).to_be_hidden()
    # The page behind still said "● active", with Rotate and Revoke, after the gateway had said otherwise.
    expect(tab.page.locator("dl.facts").first).to_contain_text("✕ revoked")
    expect(tab.page.get_by_role("button", name="Rotate secret")).to_have_count(0)


def test_an_edit_changes_only_what_was_changed_in_its_form(tab, gateway, admin_secret):
    """Two operators: one sets a budget while the other has the key's page open, then renames the key there. The
    rename sent every field of its form as the page had read them, and silently removed the budget just set."""
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys",
               json={"name": "shared", "all_models": True, "limits": {"requests_per_minute": 40}})
    key_id = made.json()["key"]["id"]
    tab.sign_in(admin_secret)
    tab.open(f"#/keys/{key_id}")
    expect(tab.page.get_by_role("heading", name="shared", level=1)).to_be_visible()
    changed = api(gateway, admin_secret, "PATCH", f"/v1/admin/keys/{key_id}",
                  json={"env": "prod", "models": ["family-a-5.5"], "all_models": False,
                        "limits": {"max_spend_day": 5, "requests_per_minute": 30}})
    assert changed.status_code == 200
    tab.page.get_by_role("button", name="Edit").click()
    dialog = tab.page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("shared-renamed")
    dialog.get_by_label("Tokens per minute").fill("9000")
    dialog.get_by_role("button", name="Save").click()
    expect(tab.page.get_by_role("heading", name="shared-renamed", level=1)).to_be_visible()
    key = api(gateway, admin_secret, "GET", f"/v1/admin/keys/{key_id}").json()["key"]
    assert (key["env"], key["all_models"], key["models"]) == ("prod", False, ["family-a-5.5"])
    assert key["limits"] == {"max_spend_day": 5, "requests_per_minute": 30, "tokens_per_minute": 9000}


def test_days_before_1970_make_no_period(tab, gateway, admin_secret):
    """Chosen days before 1970 (a year typed as 1926 for 2026) replaced the usage page, its filters included, with the
    API's "start_time must be a unix time in seconds, from 0 to 253402300800"."""
    tab.sign_in(admin_secret)
    page = tab.page
    tab.open("#/usage?from=1926-11-20&to=2026-11-21")
    alert = page.locator("main").get_by_role("alert").filter(has_text="make no period")
    expect(alert).to_contain_text("This week (since Monday, UTC) is shown instead")
    tab.open("#/usage?period=7d")
    expect(page.get_by_label("Period", exact=True)).to_have_value("7d")  # this link's page, not the one before
    page.get_by_label("Period", exact=True).select_option("custom")
    page.get_by_label("From (UTC)").fill("1926-11-20")
    page.get_by_label("To (UTC)").fill("2026-11-21")
    page.get_by_role("button", name="Show").click()  # refused by the browser, as a day to come is (min and max)
    expect(page.get_by_label("From (UTC)")).to_be_focused()
    assert page.get_by_label("From (UTC)").evaluate("field => field.validity.rangeUnderflow")
    assert page.url.endswith("#/usage?period=7d")
    page.locator("form.filters").evaluate("form => form.noValidate = true")  # and by the page itself
    page.get_by_role("button", name="Show").click()
    expect(page.locator(".dates").get_by_role("alert")).to_contain_text("no earlier than 1970-01-01")
    expect(page.get_by_label("From (UTC)")).to_be_focused()
    assert page.url.endswith("#/usage?period=7d")
    assert failed_loads_aside(tab.problems.lines) == []


def test_a_copy_that_did_not_happen_is_not_said_to_have(tab, gateway, admin_secret):
    """Served over plain http to another host, a page has no clipboard API, and the old way may copy nothing: the
    dialog said "Copied." all the same, and the secret, shown once, was closed away uncopied."""
    tab.page.add_init_script("Object.defineProperty(navigator, 'clipboard', {value: undefined});"
                             "document.execCommand = () => false;")
    tab.sign_in(admin_secret)
    tab.page.get_by_role("button", name="Create key").click()
    dialog = tab.page.get_by_role("dialog")
    dialog.get_by_label("Name").fill("copied-or-not")
    dialog.get_by_role("button", name="Create key").click()
    secret_dialog = tab.page.get_by_role("dialog", name=re.compile("^Key .* created"))
    secret_dialog.get_by_role("button", name="Copy").click()
    expect(secret_dialog.get_by_role("status")).to_contain_text("Could not copy")
    expect(secret_dialog.get_by_label("Secret")).to_be_focused()  # selected, for Ctrl+C
    assert secret_dialog.get_by_label("Secret").evaluate("box => box.selectionEnd - box.selectionStart") > 40
    secret_dialog.get_by_role("button", name="Done").click()
