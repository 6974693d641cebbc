"""Latency percentiles of the usage API (Portico's latency_ms_p50 / latency_ms_p95 on usage results).

The database counts each group's requests per latency bound (one SUM per bound, plain SQL that SQLite and
PostgreSQL both run, and as cheap as the other sums), and percentiles are estimated from those counts by linear
interpolation within a bucket, as Prometheus' histogram_quantile does from the same kind of buckets. Exact
percentiles would need every latency of the period read back; these are within a bucket's width, which is what a
dashboard needs to tell a slow hour from a normal one. Only requests that reached a model are counted: a request
refused at admission has no model latency to speak of.
"""

from __future__ import annotations

from collections.abc import Sequence

# Upper bounds in milliseconds (each bucket counts latency_ms <= bound); above the last, the last is reported.
BOUNDS_MS = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000)


def histogram_sql() -> str:
    """The SELECT list's histogram columns: cumulative counts, one per bound, then the count of requests timed."""
    timed = "upstream_attempts > 0"
    columns = [f"SUM(CASE WHEN {timed} AND latency_ms <= {bound} THEN 1 ELSE 0 END)" for bound in BOUNDS_MS]
    return ", ".join([*columns, f"SUM(CASE WHEN {timed} THEN 1 ELSE 0 END)"])


def quantile(q: float, cumulative: Sequence[int]) -> float | None:
    """The q-quantile (0 < q < 1) from histogram_sql's counts; None when no request was timed."""
    *counts, total = cumulative
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0
    for bound, count in zip(BOUNDS_MS, counts):
        if count >= rank:
            inside = count - lower_count
            fraction = (rank - lower_count) / inside if inside else 1.0
            return round(lower_bound + (bound - lower_bound) * fraction, 1)
        lower_bound, lower_count = float(bound), count
    return float(BOUNDS_MS[-1])
