"""Latency percentiles on usage results: estimated from per-bound counts the database sums (server/usage/latency.py)."""

from __future__ import annotations

from server.usage.latency import BOUNDS_MS, quantile
from server.usage.openai_pages import Page, completions_page
from server.usage.query import Totals, UsageQuery
from tests.db.test_usage_stores import ledger  # noqa: F401 - real SQLite and real PostgreSQL
from tests.unit.test_ledger_writer import NOW_MS, row


def cumulative(latencies: list[float]) -> list[int]:
    return [sum(1 for ms in latencies if ms <= bound) for bound in BOUNDS_MS] + [len(latencies)]


def test_percentiles_fall_in_the_right_bucket_and_interpolate_within_it():
    latencies = [40.0] * 50 + [400.0] * 45 + [3_000.0] * 5
    assert 25 < quantile(0.5, cumulative(latencies)) <= 50  # the median is one of the 40 ms requests
    assert 250 < quantile(0.95, cumulative(latencies)) <= 500
    assert quantile(0.99, cumulative(latencies)) > 2_500
    assert quantile(0.5, cumulative([])) is None
    assert quantile(0.5, cumulative([10 * BOUNDS_MS[-1]])) == BOUNDS_MS[-1]  # beyond the last bound: the bound


def test_the_database_sums_the_histogram_of_requests_that_reached_a_model(ledger):  # noqa: F811
    t0 = NOW_MS - NOW_MS % 1000
    rows = [row(i, at_ms=t0 + i, latency_ms=30.0 if i < 8 else 900.0) for i in range(10)]
    refused = row(99, at_ms=t0 + 50, upstream_attempts=0, status=429, code="rate_limit_exceeded", latency_ms=1.0)
    ledger.write([*rows, refused])
    [totals] = ledger.aggregate(UsageQuery(t0, t0 + 1000, 1000, latency=True))
    assert totals.latency[-1] == 10  # the refused request is not timed
    assert 25 < quantile(0.5, totals.latency) <= 50 and 500 < quantile(0.95, totals.latency) <= 1_000


def test_latency_fields_are_absent_where_no_request_reached_a_model():
    timed = Totals(0, "m", None, None, 10, 5, 0, 0, 0, model_requests=2, rows=2, errors=0,
                   latency=tuple(cumulative([40.0, 400.0])))
    refused = Totals(0, "n", None, None, 0, 0, 0, 0, 0, model_requests=0, rows=3, errors=3,
                     latency=tuple(cumulative([])))
    page = completions_page(Page(0, 60, 60, 0, 1), [timed, refused], {"model"})
    first, second = page["data"][0]["results"]
    assert 25 < first["latency_ms_p50"] <= first["latency_ms_p95"] <= 500
    assert (second["model"], second["num_requests"], second["num_model_requests"]) == ("n", 3, 0)
    assert "latency_ms_p50" not in second and "latency_ms_p95" not in second
