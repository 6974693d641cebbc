"""The retry and fallback lines, one a minute of each kind (server/providers/retry_log.py), on a clock of the test's."""

from __future__ import annotations

import logging

import pytest

from server.providers.retry_log import RetryLog
from tests.limits_support import FakeClock

RETRY = "%s/%s failed (%s); trying %s/%s"
FALLBACK = "%s failed (%s); falling back to %s"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "server.providers.router" and r.levelname == "WARNING"]


def test_a_kind_is_logged_at_once_then_counted_and_its_next_line_after_the_minute_says_how_many(clock, caplog):
    log = RetryLog(clock)
    with caplog.at_level(logging.INFO):
        log.warning(RETRY, "m", "east", "service_unavailable, 503", "m", "west")
        for _ in range(37):
            clock.now += 1
            log.warning(RETRY, "m", "east", "service_unavailable, 503", "m", "west")
        assert lines(caplog) == ["m/east failed (service_unavailable, 503); trying m/west"]
        clock.now = 1000.0 + 59.9  # the minute since the line has not passed
        log.warning(RETRY, "m", "east", "service_unavailable, 503", "m", "west")
        assert len(lines(caplog)) == 1
        clock.now = 1000.0 + 75
        log.warning(RETRY, "m", "east", "service_unavailable, 503", "m", "west")
        clock.now += 1
        log.warning(RETRY, "m", "east", "service_unavailable, 503", "m", "west")  # the next minute's: counted
    assert lines(caplog)[1:] == ["m/east failed (service_unavailable, 503); trying m/west "
                                 "(and 38 more like it, not logged, in the 75 s since the last such line)"]


def test_a_kind_met_again_after_a_quiet_minute_is_logged_as_a_first(clock, caplog):
    log = RetryLog(clock)
    with caplog.at_level(logging.INFO):
        log.warning(FALLBACK, "m", "upstream_error, 500", "b")
        clock.now += 3600
        log.warning(FALLBACK, "m", "upstream_error, 500", "b")
    assert lines(caplog) == ["m failed (upstream_error, 500); falling back to b"] * 2


def test_kinds_differing_in_anything_are_logged_each_on_their_own(clock, caplog):
    log = RetryLog(clock)
    kinds = [(RETRY, "m", "east", "service_unavailable, 503", "m", "west"),
             (RETRY, "m", "west", "service_unavailable, 503", "m", "east"),  # the other deployment failed
             (RETRY, "m", "east", "rate_limited, 429", "m", "west"),  # another reason
             (RETRY, "n", "east", "service_unavailable, 503", "n", "west"),  # another model
             (FALLBACK, "m", "service_unavailable, 503", "b"),
             (FALLBACK, "m", "service_unavailable, 503", "c"),  # gone elsewhere
             (FALLBACK, "m", "context_length_exceeded", "b")]
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            for kind in kinds:
                log.warning(*kind)
                clock.now += 1
        assert len(lines(caplog)) == len(kinds)
        clock.now += 60
        log.warning(*kinds[2])
    assert lines(caplog)[-1] == ("m/east failed (rate_limited, 429); trying m/west "
                                 "(and 2 more like it, not logged, in the 79 s since the last such line)")


def test_memory_is_bounded_and_keeps_the_counts_it_still_owes(clock, caplog):
    log = RetryLog(clock, max_kinds=3)
    with caplog.at_level(logging.INFO):
        log.warning(FALLBACK, "owed", "upstream_error, 500", "b")
        log.warning(FALLBACK, "owed", "upstream_error, 500", "b")  # counted: its next line owes it
        for n in range(10):  # a new kind every minute and a half: each is logged, and forgotten once over
            clock.now += 90
            log.warning(FALLBACK, f"m{n}", "upstream_error, 500", "b")
        assert len(log._kinds) <= 3
        log.warning(FALLBACK, "owed", "upstream_error, 500", "b")
        assert lines(caplog)[-1].endswith("(and 1 more like it, not logged, in the 900 s since the last such line)")
        for n in range(10):  # kinds all within their minute: the oldest goes, never the bound
            log.warning(FALLBACK, f"k{n}", "upstream_error, 500", "b")
        assert len(log._kinds) <= 3
