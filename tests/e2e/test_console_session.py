"""The admin console's session in a real browser: what an operator sees when the signed-in admin key stops working
or the gateway goes away while the console is open, and a key's limits as the gateway enforces them.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SIGNED_OUT = "Signed out: the admin key is no longer valid."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with running_gateway(tmp_path_factory.mktemp("console-session-data"), "--dev-key") as gateway:
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
