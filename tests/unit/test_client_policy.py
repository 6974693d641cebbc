"""portico.client's retry math and fallback walk: pure decisions, checked with chosen random draws."""

from __future__ import annotations

import itertools
import random

import httpx
import pytest

from portico.client import (
    APIConnectionError, APIError, APITimeoutError, AuthenticationError, BadRequestError, ClientRateLimitError,
    GatewayTimeoutError, HttpTransport, InternalServerError, NotFoundError, PermissionDeniedError, Plan,
    PorticoClient, RateLimitError, RetriesExhausted, RetryPolicy, ServiceUnavailableError, UpstreamError,
)
from server.domain_models import RetrySettings


def test_full_jitter_under_a_doubling_ceiling_that_stops_at_the_cap():
    policy = RetryPolicy(attempts=10, base=0.5, cap=4.0)
    assert [policy.ceiling(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    error = InternalServerError("boom")
    assert policy.delay(3, error, 0.0) == 0.0
    assert policy.delay(3, error, 0.5) == 1.0
    assert policy.delay(3, error, 0.999) == pytest.approx(1.998)
    assert policy.ceiling(10_000) == 4.0  # no overflow however many retries


def test_jitter_spreads_uniformly_over_the_whole_range():
    policy, draw = RetryPolicy(base=1.0, cap=8.0), random.Random(7).random
    delays = [policy.delay(3, InternalServerError("x"), draw()) for _ in range(2000)]
    assert 0 <= min(delays) < 0.1 and 3.9 < max(delays) < 4.0
    assert 1.8 < sum(delays) / len(delays) < 2.2



def test_jitter_is_a_setting_of_the_policy_full_by_default():
    """Issue 8 names the policy's settings as attempts, base, cap and jitter; `jitter` was not one of them (a
    TypeError). Full jitter stays the default; without it the wait is the ceiling itself, the hint still a floor."""
    assert RetryPolicy().jitter is True
    steady = RetryPolicy(base=0.5, cap=4.0, jitter=False)
    assert [steady.delay(n, InternalServerError("x"), 0.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert steady.delay(1, RateLimitError("slow down", retry_after=3.2), 0.0) == 3.2
    assert steady.delay(1, RateLimitError("tomorrow", retry_after=3600.0), 0.0) is None
    assert RetryPolicy(jitter=True).delay(2, InternalServerError("x"), 0.25) == 0.25

def test_the_servers_hint_is_a_floor_and_a_hint_over_the_cap_means_do_not_wait():
    policy = RetryPolicy(base=0.5, cap=10.0)
    assert policy.delay(1, RateLimitError("slow down", retry_after=3.2), 0.9) == 3.2
    assert policy.delay(5, RateLimitError("slow down", retry_after=3.2), 0.9) == pytest.approx(7.2)
    assert policy.delay(1, RateLimitError("slow down", retry_after=10.0), 0.9) == 10.0
    assert policy.delay(1, RateLimitError("tomorrow", retry_after=3600.0), 0.0) is None


@pytest.mark.parametrize("error, retryable", [
    (BadRequestError("x"), False), (BadRequestError("too big", status=413), False), (AuthenticationError("x"), False),
    (PermissionDeniedError("x"), False), (NotFoundError("x"), False), (GatewayTimeoutError("x"), False),
    (RateLimitError("x"), True), (InternalServerError("x"), True), (ServiceUnavailableError("x"), True),
    (APIConnectionError("refused"), True), (ClientRateLimitError("mine"), False),
    (APIError("bad gateway", status=502), True), (APITimeoutError("ReadTimeout"), False),
    (RateLimitError("Request too large", should_retry=False), False),
    (ServiceUnavailableError("x", should_retry=False), False), (RateLimitError("x", should_retry=True), True),
])
def test_only_429_500_502_503_and_connection_errors_are_retried(error, retryable):
    assert RetryPolicy().retryable(error) is retryable


def test_a_policy_that_would_retry_a_client_error_is_refused():
    with pytest.raises(ValueError, match="never retried"):
        RetryPolicy(retry_statuses=frozenset({404, 503}))
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(base=2, cap=1)


def plan(*models: str, draws=(0.5,), **policy) -> Plan:
    return Plan(models, RetryPolicy(**policy), itertools.cycle(draws).__next__)


def test_a_model_is_retried_up_to_its_attempts_then_the_fallbacks_then_everything_is_given_up():
    walk = plan("primary", "fallback", attempts=3, base=1.0, cap=10.0)
    waits, models = [], [walk.model]
    for _ in range(5):
        waits.append(walk.failed(ServiceUnavailableError("down")))
        models.append(walk.model)
    assert models == ["primary", "primary", "primary", "fallback", "fallback", "fallback"]
    assert waits == [0.5, 1.0, 0.0, 0.5, 1.0]  # draw 0.5 of ceilings 1, 2; no wait before switching models
    last = InternalServerError("still down")
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(last)
    assert caught.value.last is last and caught.value.__cause__ is last
    assert [model for model, _ in caught.value.failures] == ["primary"] * 3 + ["fallback"] * 3
    assert "gave up after 6 attempt(s) on primary -> fallback" in str(caught.value)
    assert "500 internal_error: still down" in str(caught.value)


def test_a_client_error_of_the_primary_is_raised_as_is_at_once():
    for error in (BadRequestError("temperature", param="temperature"), NotFoundError("no such model")):
        walk = plan("primary", "fallback")
        with pytest.raises(type(error)) as caught:
            walk.failed(error)
        assert caught.value is error and walk.model == "primary"


def test_a_fallback_that_cannot_serve_the_request_is_skipped():
    walk = plan("primary", "ungranted", "last", attempts=1)
    assert walk.failed(RateLimitError("busy", retry_after=1.0)) == 0.0 and walk.model == "ungranted"
    assert walk.failed(NotFoundError("not granted")) == 0.0 and walk.model == "last"
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(NotFoundError("not granted either"))
    assert [type(e) for _, e in caught.value.failures] == [RateLimitError, NotFoundError, NotFoundError]


def test_a_hint_longer_than_the_cap_moves_on_without_waiting():
    walk = plan("primary", "fallback", attempts=5, cap=30.0)
    assert walk.failed(RateLimitError("per minute", retry_after=58.0)) == 0.0
    assert walk.model == "fallback"
    assert walk.failed(RateLimitError("per minute", retry_after=2.5)) == 2.5 and walk.model == "fallback"


def test_a_refusal_until_later_marked_not_to_retry_moves_on_to_the_fallback():
    # A daily quota or budget: x-should-retry false, as the SDKs must not sleep until UTC midnight, but a retry hint.
    walk = plan("primary", "fallback", attempts=3, cap=300.0)
    assert walk.failed(RateLimitError("daily requests", retry_after=100.0, should_retry=False)) == 0.0
    assert walk.model == "fallback"
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(RateLimitError("the key's budget", retry_after=30_000.0, should_retry=False))
    assert len(caught.value.failures) == 2
    too_large = RateLimitError("Request too large", should_retry=False)  # no wait lets it through: raised as is
    with pytest.raises(RateLimitError) as caught:
        plan("primary", "fallback").failed(too_large)
    assert caught.value is too_large


def test_a_model_whose_side_fails_marked_not_to_retry_moves_on_to_the_fallback():
    # A 502 whose upstream refuses the gateway's key or account: this model will not answer, the next may.
    refused = UpstreamError("refused Portico's credentials", should_retry=False)
    walk = plan("primary", "fallback", attempts=3)
    assert walk.failed(refused) == 0.0 and walk.model == "fallback"
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(ServiceUnavailableError("overloaded, do not retry", should_retry=False))
    assert [model for model, _ in caught.value.failures] == ["primary", "fallback"]
    with pytest.raises(UpstreamError) as alone:  # no fallback: the error as it is, as before
        plan("only").failed(refused)
    assert alone.value is refused


def test_one_attempt_means_no_retry():
    walk = plan("only", attempts=1)
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(APIConnectionError("refused"))
    assert len(caught.value.failures) == 1 and isinstance(caught.value.last, APIConnectionError)


def test_the_default_retry_statuses_are_the_gateways():
    """The gateway retries its upstreams on these statuses; 529 (Anthropic overloaded) reaches callers as 503."""
    gateway = set(RetrySettings().on_status) - {529}
    assert RetryPolicy().retry_statuses == gateway


def test_a_post_that_timed_out_is_not_sent_again():
    """A read timeout on a POST: the request went out and may still be running (and billed), so no retry."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        raise httpx.ReadTimeout("timed out", request=request)

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = PorticoClient(HttpTransport("http://127.0.0.1:9", "pk-test", http=http), random=lambda: 0.0, sleep=lambda seconds: None)
    with pytest.raises(APITimeoutError):
        client.chat_completion("family-a-5.5", [{"role": "user", "content": "Hi"}], max_tokens=1)
    assert calls == ["POST"]
    with pytest.raises(RetriesExhausted):  # a GET that timed out is safe to send again
        client.list_models()
    assert calls == ["POST", "GET", "GET", "GET"]



def test_giving_up_on_a_call_without_a_model_names_no_model():
    """list_models and other model-less calls: the message read "gave up after 3 attempt(s) on ; last error: ..."."""
    walk = plan("", attempts=2)
    walk.failed(ServiceUnavailableError("down"))
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(ServiceUnavailableError("still down"))
    assert str(caught.value) == "gave up after 2 attempt(s); last error: 503 service_unavailable: still down"


@pytest.mark.parametrize(("retry_after", "shown"),
                         [(58.1503, "58.2s"), (59.99658, "60.0s"), (0.04, "0.1s"), (2.0, "2.0s")])
def test_an_error_s_retry_hint_reads_in_tenths_of_a_second_as_client_md_shows_it(retry_after, shown):
    """client.md's example, `... retry after 58.2s`, read `retry after 58.1503s` (a server's retry-after-ms, or the
    client's own limiter's wait, to 6 digits): the hint is rounded up to a tenth, as the gateway's message is, so it
    never says to retry sooner than the server asked."""
    walk = plan("family-a-5.5", attempts=1)
    with pytest.raises(RetriesExhausted) as caught:
        walk.failed(RateLimitError("Rate limit reached ...", retry_after=retry_after))
    assert str(caught.value).endswith(f"429 rate_limit_exceeded: Rate limit reached ..., retry after {shown}")
