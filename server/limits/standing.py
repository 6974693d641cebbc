"""What a key's limits stand at now, for operators (LimitService, the console's key page): read, never booked.

Stores report a scope's raw Counts; one pure function turns them into Readings, so the memory and Redis stores
cannot disagree about what is left. A Reading here holds what is counted now (no request's demand added), and
`wait` is how long until the count next goes down: the oldest request leaving the window, UTC midnight for daily
limits, 0 when nothing is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.limits.core import (
    WINDOW_SECONDS, Dimension, Reading, Scope, until_midnight, until_month_end, within_a_minute,
)


@dataclass(frozen=True, slots=True)
class Counts:
    """One scope's counters as they were at `at` (the store's clock)."""

    at: float
    window: tuple[tuple[float, int], ...]  # (admitted at, tokens) of each request in the rolling window, oldest first
    in_flight: int
    day_requests: int
    day_tokens: int
    day_spend: int = 0  # micro-dollars
    month_spend: int = 0
    # Seconds until the day's and the month's counters reset; None: UTC midnight and the month's end from `at` (the
    # in-process store's counters may count a later day: MemoryLimitStore's until_reset).
    to_day_end: float | None = None
    to_month_end: float | None = None


def standing(scope: Scope, counts: Counts) -> list[Reading]:
    readings, now = [], counts.at
    # Entries another host booked, by its clock (within_a_minute).
    to_window_end = within_a_minute(counts.window[0][0] + WINDOW_SECONDS - now) if counts.window else 0.0
    # The tokens go down when the first entry with tokens leaves: one without (a token count, an image, a failed
    # request) frees none.
    to_tokens_end = within_a_minute(next((at + WINDOW_SECONDS - now for at, tokens in counts.window if tokens), 0.0))
    to_day_end = until_midnight(now) if counts.to_day_end is None else counts.to_day_end
    to_month_end = until_month_end(now) if counts.to_month_end is None else counts.to_month_end
    for dimension in Dimension:
        limit = scope.limit(dimension)
        if limit is None:
            continue
        if dimension is Dimension.REQUESTS_PER_MINUTE:
            used, wait = len(counts.window), to_window_end
        elif dimension is Dimension.TOKENS_PER_MINUTE:
            used, wait = sum(tokens for _, tokens in counts.window), to_tokens_end
        elif dimension is Dimension.CONCURRENT_REQUESTS:
            used, wait = counts.in_flight, 0.0  # a slot frees when some request ends: nobody can say when
        elif dimension is Dimension.DAILY_REQUESTS:
            used, wait = counts.day_requests, to_day_end if counts.day_requests else 0.0
        elif dimension is Dimension.DAILY_SPEND:
            used, wait = counts.day_spend, to_day_end if counts.day_spend else 0.0
        elif dimension is Dimension.MONTHLY_SPEND:
            used, wait = counts.month_spend, to_month_end if counts.month_spend else 0.0
        elif dimension is Dimension.DAILY_TOKENS:
            used, wait = counts.day_tokens, to_day_end if counts.day_tokens else 0.0
        else:
            continue  # a dimension these counts do not hold
        readings.append(Reading(scope, dimension, limit, used, max(0.0, wait)))
    return readings
