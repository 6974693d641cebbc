"""The admin console as a person uses it, in a real browser: what they type to find a key, and what they read
about it, against what the admin API answers.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import expect

import server
from tests.e2e.browser import api, new_admin_secret
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The default catalog, family-a-5.5 priced with free prompt-cache reads and family-a-5.4 without a cache price
    (its cache reads cost its input price)."""
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    models = {model["id"]: model for model in config["models"]}
    models["family-a-5.5"]["price"] = {"input": 1, "output": 2, "cached_input": 0}
    models["family-a-5.4"]["price"] = {"input": 3, "output": 15}
    models["family-b-sonnet-4-6"]["price"] = {"input": 3, "output": 15, "cache_write": 3.75, "cache_write_1h": 6,
                                              "web_search": 0.01}
    path = tmp_path_factory.mktemp("console-people-config") / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(tmp_path_factory.mktemp("console-people-data"), config=path) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_secret(gateway) -> str:
    return new_admin_secret(gateway)


@pytest.mark.parametrize(("name", "typed"), [
    ("İzmir ops", "izmir"),  # a capital dotted I: lowercased, it was "i̇" (i and a combining dot), never "i"
    ("Ünïcode team", "unicode"),
    (unicodedata.normalize("NFD", "Café billing"), "café"),  # made by a script with decomposed text (macOS)
    ("Straße-Süd", "STRASSE-SUD"),
])
def test_a_key_is_found_by_its_name_as_a_person_types_it(tab, gateway, admin_secret, name, typed):
    """The keys' search lowercased both sides and compared code points: "izmir" found no "İzmir ops", nor "unicode"
    "Ünïcode team", nor "café" (typed) a "Café" made with a decomposed é, though each is in the list."""
    made = api(gateway, admin_secret, "POST", "/v1/admin/keys", json={"name": name, "all_models": True}).json()
    tab.sign_in(admin_secret)
    tab.open("#/keys")
    tab.page.get_by_label("Name or id").fill(typed)
    tab.page.get_by_role("button", name="Filter").click()
    links = tab.page.get_by_role("region", name="API keys").get_by_role("link")
    expect(links).to_have_count(1)
    expect(links).to_have_attribute("href", f"#/keys/{made['key']['id']}")
    assert tab.page.get_by_label("Name or id").input_value() == typed  # as typed, not as compared


def test_a_models_price_says_what_its_cached_input_costs(tab, gateway, admin_secret):
    """A model configured with free prompt-cache reads (cached_input: 0) showed "$1.00 in / $2.00 out per 1M
    tokens" and nothing more, read as "cached input costs $1.00 too", while a model without a cache price showed its
    input price again as "cached in"."""
    prices = {model["id"]: model["price"] for model in
              api(gateway, admin_secret, "GET", "/v1/admin/models").json()["models"]}
    assert prices["family-a-5.5"]["cached_input"] == 0 and prices["family-a-5.4"]["cached_input"] == 3
    tab.sign_in(admin_secret)
    tab.open("#/models")
    catalog = tab.page.get_by_role("region", name="The model catalog")
    price = lambda model: catalog.get_by_role("row").filter(has_text=model).first.get_by_role("cell").nth(2)
    expect(price("family-a-5.5")).to_have_text("$1.00 in / $2.00 out per 1M tokens; $0.00 cached in per 1M")
    expect(price("family-a-5.4")).to_have_text("$3.00 in / $15.00 out per 1M tokens")


def test_a_models_price_says_what_hour_long_cache_writes_and_web_searches_cost(tab, gateway, admin_secret):
    """Anthropic bills an hour-long prompt-cache write above a five-minute one, and each web search: the admin API
    and the console listed neither price, so an operator could not check what a key's spend was made of."""
    price = {model["id"]: model["price"] for model in
             api(gateway, admin_secret, "GET", "/v1/admin/models").json()["models"]}["family-b-sonnet-4-6"]
    assert (price["cache_write"], price["cache_write_1h"], price["web_search"]) == (3.75, 6, 0.01)
    tab.sign_in(admin_secret)
    tab.open("#/models")
    catalog = tab.page.get_by_role("region", name="The model catalog")
    row = catalog.get_by_role("row").filter(has_text="family-b-sonnet-4-6").first
    expect(row.get_by_role("cell").nth(2)).to_have_text(
        "$3.00 in / $15.00 out per 1M tokens; $3.75 cache writes per 1M; $6.00 hour-long cache writes per 1M; "
        "$0.01 per web search")


@pytest.mark.parametrize("pasted", ["Bearer {secret}", "Authorization: Bearer {secret}", "bearer  {secret}",
                                    "x-api-key: {secret}"])
def test_a_key_pasted_with_its_header_from_a_curl_command_signs_in(tab, admin_secret, pasted):
    """A person copies the key from a curl command or a request's headers, with its header name or scheme: that is
    the key they mean (no key holds a space), not "That key is not valid"."""
    tab.sign_in(pasted.format(secret=admin_secret))
