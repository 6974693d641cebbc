"""The admin console as a person uses it, in a real browser: what they type to find a key, and what they read
about it, against what the admin API answers.
"""

from __future__ import annotations

import unicodedata

import pytest
from playwright.sync_api import expect

from tests.e2e.browser import api, new_admin_secret
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("console-people-data"), "--dev-key") as gateway:
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
