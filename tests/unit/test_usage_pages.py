"""The usage API's pages (server/usage/openai_pages.py): what a key with no env shows as its project."""

from __future__ import annotations

import base64

import pytest

from server.errors import InvalidRequest
from server.usage.openai_pages import (
    COMPLETIONS_LIMITS, COSTS_LIMITS, Page, completions_page, costs_page, parse_row_cursor, plan_page, requests_page,
)
from server.usage.query import Totals
from tests.unit.test_ledger_writer import row


def test_a_key_without_an_env_has_a_null_project_everywhere():
    """OpenAI's project_id is null where there is none: the same in usage, costs and the request rows (the rows
    said "" where the grouped results said null)."""
    no_env = Totals(0, "m", "key_a", "", 10, 5, 0, 0, 7, model_requests=1, rows=1, errors=0, latency=())
    page = Page(0, 60, 60, 0, 1)
    [usage] = completions_page(page, [no_env], {"project_id"})["data"][0]["results"]
    [cost] = costs_page(page, [no_env], {"project_id"})["data"][0]["results"]
    [request] = requests_page([row(1, env="")], 10)["data"]
    assert usage["project_id"] is None and cost["project_id"] is None and request["project_id"] is None
    assert requests_page([row(1, env="prod")], 10)["data"][0]["project_id"] == "prod"


def test_a_row_cursor_is_refused_unless_it_names_a_row_id_the_ledger_makes():
    """Row ids are hex: a forged cursor naming one with a NUL went on to PostgreSQL, which refused it with a 500."""
    assert parse_row_cursor("page_" + base64.urlsafe_b64encode(b"1795761431254:51cdf809db0").decode()) == (
        1795761431254, "51cdf809db0")
    for row_id in (b"\x00", b"ab\x00", b"r1 x"):
        forged = "page_" + base64.urlsafe_b64encode(b"1:" + row_id).decode().rstrip("=")
        with pytest.raises(InvalidRequest) as refused:
            parse_row_cursor(forged)
        assert refused.value.param == "page"


@pytest.mark.parametrize("limits", [COMPLETIONS_LIMITS, COSTS_LIMITS])
def test_bucket_width_all_is_one_bucket_from_start_time_to_end_time_as_given(limits):
    """A period's totals per key or model in one result each (the console's tables), whatever its length, from a
    start that is no whole minute, and with no next page."""
    page = plan_page(100, 1_000, "all", None, "", limits=limits, now=5_000)
    assert (page.start, page.first, page.stop, page.buckets, page.next_page) == (100, 100, 1_000, 1, None)
    assert costs_page(page, [], set())["data"] == [{"object": "bucket", "start_time": 100, "end_time": 1_000,
                                                    "results": []}]
    assert plan_page(7, None, "all", 1, "", limits=limits, now=86_400 * 30.5).stop == 86_400 * 30 + 43_201
    with pytest.raises(InvalidRequest) as refused:
        plan_page(100, 1_000, "all", 2, "", limits=limits, now=5_000)
    # It said "limit must be between 1 and 1 for bucket_width all."
    assert (refused.value.param, str(refused.value)) == ("limit", "limit must be 1 for bucket_width all (one bucket).")
