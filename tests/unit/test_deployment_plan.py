"""The pure parts of deployments: the planner's walk over deployments and fallbacks, the balancing choice, and the
passive health state machine (on both boards, the shared file one from two processes' worth of handles)."""

from __future__ import annotations

import random

import pytest

from server.domain_models import HealthSettings
from server.domain_models import RetrySettings
from server.errors import InvalidRequest, RateLimited, ServiceUnavailable
from server.providers import health
from server.providers.health import FileBoard, MemoryBoard
from server.providers.retry import OutOfService, Plan, Step, Target, pick

RETRY = RetrySettings(attempts=2, initial_backoff=1.0, max_backoff=1.0, total_seconds=10)
BUSY = ServiceUnavailable("busy", retry_reason="503")


def plan(*models: int, ready=lambda m, d: 0.0, draw=lambda: 0.0) -> Plan:
    return Plan([[Target(1.0, RETRY)] * n for n in models], ready_in=ready, in_flight=lambda m, d: 0, draw=draw)


def test_a_failure_moves_to_an_untried_deployment_at_once_then_retries_after_backoff_then_falls_back():
    p = plan(2, 1)
    first = p.next(0.0)
    assert first == Step(0, 0, 0.0)
    p.failed(first, BUSY, 0.0)
    assert p.next(0.0) == Step(0, 1, 0.0)  # the other deployment, no wait
    p.failed(Step(0, 1, 0.0), BUSY, 0.0)
    again = p.next(0.0)
    assert again.model == 0 and again.wait == 0.0  # draw 0: full jitter's shortest backoff
    p.failed(again, BUSY, 0.1)
    p.failed(p.next(0.1), BUSY, 0.2)  # both have used their two attempts
    assert p.next(0.2) == Step(1, 0, 0.0)  # the fallback
    p.failed(Step(1, 0, 0.0), BUSY, 0.3)
    assert p.next(1.3) == Step(1, 0, 0.0)
    p.failed(Step(1, 0, 0.0), BUSY, 1.3)
    assert p.next(1.3) is None and p.give_up(1.3) is BUSY


def test_a_failure_another_try_would_meet_too_is_raised():
    p = plan(2)
    with pytest.raises(InvalidRequest):
        p.failed(p.next(0.0), InvalidRequest("bad"), 0.0)


def too_long(window: int) -> InvalidRequest:
    return InvalidRequest(f"maximum context length is {window} tokens", code="context_length_exceeded")


def test_a_prompt_over_the_window_goes_to_the_next_model_at_once_not_to_another_deployment():
    p = plan(2, 1, 1)
    p.failed(p.next(0.0), too_long(8192), 0.0)
    assert p.next(0.0) == Step(1, 0, 0.0)  # no retry, no other deployment: they share the model's window
    refusal = too_long(8192)
    p = plan(1, 1)
    p.failed(p.next(0.0), refusal, 0.0)
    p.failed(p.next(0.0), too_long(128000), 0.0)
    assert p.next(0.0) is None and p.give_up(0.0) is refusal  # the model asked for's refusal


def test_a_fallback_that_failed_in_a_way_that_clears_is_answered_rather_than_the_refusal():
    p = plan(1, 1)
    p.failed(p.next(0.0), too_long(8192), 0.0)
    p.failed(p.next(0.0), BUSY, 0.0)
    p.failed(p.next(1.0), BUSY, 1.0)
    assert p.next(1.0) is None and p.give_up(1.0) is BUSY
    p = plan(1, 1, ready=lambda m, d: 7.0 if m == 1 else 0.0)  # the fallback is out of service for 7 s
    p.failed(p.next(0.0), too_long(8192), 0.0)
    assert p.next(0.0) is None and (p.give_up(0.0).kind.http_status, p.give_up(0.0).retry_after) == (503, 7)
    assert not isinstance(p.give_up(0.0), OutOfService)  # the model asked for was asked: the request reached it


def test_deployments_out_of_service_are_passed_over_and_a_model_with_none_left_goes_to_its_fallback():
    out = {(0, 0): 5.0}
    p = plan(2, 1, ready=lambda m, d: out.get((m, d), 0.0))
    assert p.next(0.0) == Step(0, 1, 0.0)
    out[(0, 1)] = 30.0
    p = plan(2, 1, ready=lambda m, d: out.get((m, d), 0.0))
    assert p.next(0.0) == Step(1, 0, 0.0)


def test_nothing_in_service_answers_503_with_the_soonest_return():
    p = plan(2, ready=lambda m, d: 4.2)
    assert p.next(0.0) is None
    error = p.give_up(0.0)
    assert isinstance(error, ServiceUnavailable) and error.retry_after == 5


def test_a_retry_after_longer_than_the_budget_moves_on_instead_of_waiting():
    p = plan(2)
    first = p.next(0.0)
    p.failed(first, RateLimited("quota", retry_after=60, retry_reason="429"), 0.0)
    second = p.next(0.0)
    p.failed(second, RateLimited("quota", retry_after=60, retry_reason="429"), 0.0)
    assert p.next(0.0) is None


def test_when_everything_fails_the_caller_is_told_the_soonest_retry_after_among_the_failures():
    once = RetrySettings(attempts=1)
    p = Plan([[Target(1.0, once)] * 2], ready_in=lambda m, d: 0.0, in_flight=lambda m, d: 0, draw=lambda: 0.0)
    p.failed(p.next(0.0), RateLimited("soon", retry_after=2, retry_reason="429"), 0.0)
    p.failed(p.next(0.0), RateLimited("late", retry_after=30, retry_reason="429"), 0.5)
    assert p.next(0.5) is None
    error = p.give_up(0.5)
    assert error.message == "soon" and error.retry_after == 2  # not 30
    # Across fallbacks too; a failure without a retry-after may pass at once, so it wins (no hint: SDK backoff).
    p = Plan([[Target(1.0, once)]] * 3, ready_in=lambda m, d: 0.0, in_flight=lambda m, d: 0, draw=lambda: 0.0)
    p.failed(p.next(0.0), RateLimited("late", retry_after=30, retry_reason="429"), 0.0)
    p.failed(p.next(0.0), ServiceUnavailable("down", retry_reason="503"), 0.0)
    p.failed(p.next(0.0), RateLimited("soon", retry_after=2, retry_reason="429"), 0.0)
    error = p.give_up(0.0)
    assert error.message == "down" and error.retry_after == 0
    # A deployment passed over (out of service) that is back before the failure's hint shortens it.
    p = plan(2, ready=lambda m, d: 5.0 if d == 1 else 0.0)
    p.failed(p.next(0.0), RateLimited("late", retry_after=30, retry_reason="429"), 0.0)
    assert p.next(0.0) is None and p.give_up(0.0).retry_after == 5


def test_a_failure_that_ejected_its_deployment_clears_when_the_deployment_is_back():
    """The request whose failures took every deployment out of service: its answer's retry-after is when one is back,
    not "at once" (a caller retrying at once would only meet the gateway's own out-of-service 503)."""
    once = RetrySettings(attempts=1)
    out: dict[tuple[int, int], float] = {}
    p = Plan([[Target(1.0, once)] * 2], ready_in=lambda m, d: out.get((m, d), 0.0), in_flight=lambda m, d: 0,
             draw=lambda: 0.0)
    first = p.next(0.0)
    p.failed(first, ServiceUnavailable("down", retry_reason="503"), 0.0)
    out[(0, first.deployment)] = 5.0  # ejected for its cooldown
    second = p.next(0.0)
    p.failed(second, ServiceUnavailable("down too", retry_reason="503"), 0.0)
    out[(0, second.deployment)] = 3.0
    assert p.next(0.0) is None
    error = p.give_up(0.0)
    assert error.message == "down too" and error.retry_after == 3
    assert BUSY.retry_after == 0  # errors may be shared: the hint goes on a copy


def test_pick_follows_weights_and_prefers_idle_deployments():
    rng = random.Random(7)
    counts = [0, 0]
    for _ in range(4000):
        counts[pick([3.0, 1.0], [0, 0], rng.random)] += 1
    assert 2850 <= counts[0] <= 3150
    busy = sum(pick([1.0, 1.0], [9, 0], rng.random) for _ in range(1000))
    assert busy > 850  # weight / (in flight + 1): the idle one gets ~10 in 11


@pytest.mark.parametrize("weights", [[9.0, 1.0], [0.3, 0.1], [3.0, 1.0, 1.0]], ids=["9:1", "fractional", "three"])
def test_weights_are_followed_under_concurrent_load_too(weights):
    """32 requests always in flight on deployments equally fast (one ends, at random, and the next is picked): each
    gets its weight's share, as one at a time does. Dividing each weight by its requests in flight + 1 gave 9:1 only
    ~75:25 (sqrt(9):1 as the load grows), so a small deployment's quota took 2.5 times the traffic it was given."""
    rng = random.Random(11)
    in_flight = [0] * len(weights)
    for _ in range(32):
        in_flight[pick(weights, in_flight, rng.random)] += 1
    counts = [0] * len(weights)
    for _ in range(20000):
        ended = rng.choices(range(len(weights)), weights=in_flight)[0]
        in_flight[ended] -= 1
        chosen = pick(weights, in_flight, rng.random)
        in_flight[chosen] += 1
        counts[chosen] += 1
    shares = [count / 20000 for count in counts]
    assert shares == pytest.approx([w / sum(weights) for w in weights], abs=0.03)


SETTINGS = HealthSettings(consecutive_failures=3, failure_rate=0.5, window_seconds=10, min_requests=6,
                          cooldown_seconds=2, max_cooldown_seconds=5)


def test_consecutive_failures_eject_then_one_trial_decides_with_a_growing_cooldown():
    h = health.DeploymentHealth()
    for t in (0.0, 0.1):
        health.failed(h, t, SETTINGS)
    assert health.state_of(h, 0.2) == "healthy"
    health.failed(h, 0.2, SETTINGS)
    assert health.state_of(h, 0.3) == "ejected" and health.ready_at(h, 0.3) == pytest.approx(2.2)
    assert health.state_of(h, 2.3) == "trial"
    assert health.acquire(h, 2.3) and not health.acquire(h, 2.4)  # one trial at a time
    health.failed(h, 2.5, SETTINGS)  # the trial failed: twice as long
    assert health.ready_at(h, 2.6) == pytest.approx(6.5)
    assert health.acquire(h, 6.5)
    health.failed(h, 6.6, SETTINGS)
    assert health.ready_at(h, 6.7) == pytest.approx(11.6)  # capped at max_cooldown_seconds
    assert health.acquire(h, 11.6)
    health.succeeded(h, 11.7, SETTINGS)
    assert health.state_of(h, 11.8) == "healthy" and h.ejections == 0


def test_a_trial_that_begins_answering_brings_it_back_on_probation():
    h = health.DeploymentHealth()
    for t in (0.0, 0.1, 0.2):
        health.failed(h, t, SETTINGS)
    assert health.acquire(h, 2.3) is health.Admission.TRIAL
    health.answering(h, 2.4, SETTINGS)  # its first words: taking requests again while that answer runs
    assert health.state_of(h, 2.4) == "healthy" and health.acquire(h, 2.4) is health.Admission.ADMITTED
    health.failed(h, 3.0, SETTINGS)  # an answer failing before one ended whole: still the trial failing
    assert health.state_of(h, 3.1) == "ejected" and health.ready_at(h, 3.1) == pytest.approx(7.0)
    assert health.acquire(h, 7.0) is health.Admission.TRIAL
    health.answering(h, 7.1, SETTINGS)
    health.succeeded(h, 9.0, SETTINGS)  # a whole answer: off probation, the next ejection from the start again
    assert (h.consecutive, h.ejections) == (0, 0)
    health.failed(h, 9.1, SETTINGS)
    assert health.state_of(h, 9.2) == "healthy"


def test_a_failure_rate_over_the_window_ejects():
    h = health.DeploymentHealth()
    for i in range(6):  # alternate: never 3 in a row, but half of 6 requests failed
        (health.failed if i % 2 else health.succeeded)(h, i * 0.1, SETTINGS)
    assert health.state_of(h, 0.6) == "ejected"
    h = health.DeploymentHealth()
    for i in range(6):
        (health.failed if i % 2 else health.succeeded)(h, i * 3.0, SETTINGS)  # spread past the window
    assert health.state_of(h, 18.0) == "healthy"


def test_retry_after_cools_exactly_that_long_with_no_trial():
    h = health.DeploymentHealth()
    health.failed(h, 1.0, SETTINGS, retry_after=2.0)
    assert health.ready_at(h, 1.5) == 3.0 and health.state_of(h, 3.0) == "healthy"


def test_retry_after_on_a_trial_cools_exactly_that_long_too():
    h = health.DeploymentHealth(ejected_until=1.0, needs_trial=True, ejections=1)
    assert health.acquire(h, 1.0)  # the trial meets a 429 with retry-after: 3
    health.failed(h, 1.1, SETTINGS, retry_after=3.0)
    assert health.ready_at(h, 1.2) == pytest.approx(4.1)  # not a doubled cooldown
    assert health.state_of(h, 4.1) == "healthy" and health.acquire(h, 4.1) and health.acquire(h, 4.2)
    for t in (5.0, 5.1, 5.2):
        health.failed(h, t, SETTINGS)
    assert health.ready_at(h, 5.3) == pytest.approx(7.2)  # healthy again: a later ejection starts afresh


def test_a_retry_after_met_during_a_cooldown_after_failures_keeps_the_trial_and_its_doubling():
    """A request sent before the ejection meets a 429 with retry-after during the cooldown: it made the deployment
    healthy once the longer of the two was over, with no trial and its record of failed trials gone."""
    h = health.DeploymentHealth(ejected_until=10.0, needs_trial=True, ejections=2)
    health.failed(h, 5.0, SETTINGS, retry_after=1.0)  # sooner than the cooldown: nothing new
    assert health.ready_at(h, 5.1) == 10.0 and health.state_of(h, 10.0) == "trial" and h.ejections == 2
    health.failed(h, 6.0, SETTINGS, retry_after=8.0)  # later: out until then, and then a trial still decides
    assert health.ready_at(h, 6.1) == 14.0 and health.state_of(h, 14.0) == "trial" and h.ejections == 2


def test_outcomes_of_requests_sent_before_an_ejection_change_nothing_after_the_cooldown_either():
    h = health.DeploymentHealth()
    for t in (0.0, 0.1, 0.2):
        health.failed(h, t, SETTINGS, sent=t)  # ejected at 0.2 until 2.2
    health.failed(h, 3.0, SETTINGS, sent=0.15)  # sent before the ejection, timed out after the cooldown
    assert health.state_of(h, 3.0) == "trial" and h.ejections == 1  # not a failed trial: no doubling
    assert health.acquire(h, 3.0) is health.Admission.TRIAL
    health.succeeded(h, 3.1, SETTINGS, sent=0.1)  # nor does an old success end the trial
    assert health.state_of(h, 3.1) == "trial"
    health.succeeded(h, 3.2, SETTINGS, sent=3.0)  # the trial decides
    assert health.state_of(h, 3.2) == "healthy"


def test_a_trial_abandoned_by_its_caller_is_free_for_the_next_request():
    h = health.DeploymentHealth(ejected_until=1.0, needs_trial=True)
    assert health.acquire(h, 1.0)
    health.released(h)
    assert health.acquire(h, 1.1)


@pytest.mark.parametrize("shared", [False, True])
def test_boards_keep_state_per_deployment(tmp_path, shared):
    now = [0.0]
    watched = [("m", "a", SETTINGS), ("m", "b", SETTINGS)]
    make = (lambda: FileBoard(tmp_path / "health", watched, clock=lambda: now[0])) if shared else (
        lambda: MemoryBoard(watched, clock=lambda: now[0]))
    board = make()
    other = make() if shared else board  # a second worker process's view of the same file
    for _ in range(3):
        board.failed(0)
    assert other.states() == [("m", "a", "ejected"), ("m", "b", "healthy")]
    assert other.ready_in(0) == 2.0 and other.ready_in(1) == 0.0
    now[0] = 2.0
    assert other.acquire(0) and not board.acquire(0)  # the one trial, whichever process asks first
    other.succeeded(0)
    assert board.states()[0][2] == "healthy"
    if shared:
        assert (tmp_path / "health").stat().st_mode & 0o777 == 0o600
        other.close()
    board.close()


def _config(tmp_path, entry: str):
    from server.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  - {{id: m, endpoint: /v1/chat/completions, {entry}}}\n")
    return load_config(path)


def test_deployments_health_and_cache_are_read_from_a_model_entry(tmp_path):
    up = "{kind: openai, base_url: 'http://127.0.0.1:1/v1', model: x}"
    entry = _config(tmp_path, f"deployments: [{{name: a, weight: 3, provider: {up}}}, {{name: b, provider: "
                              f"{{kind: llamacpp}}}}], health: {{consecutive_failures: 5}}, "
                              "cache: {ttl_seconds: 60, shared: true}").models[0]
    assert [(d.name, d.weight, d.provider.kind) for d in entry.deployments] == [("a", 3.0, "openai"),
                                                                              ("b", 1.0, "llamacpp")]
    assert entry.provider.kind == "openai" and entry.health.consecutive_failures == 5
    assert entry.cache.ttl_seconds == 60 and entry.cache.shared and entry.cache.max_entry_bytes == 1024 * 1024
    plain = _config(tmp_path, "provider: {kind: llamacpp}").models[0]
    assert [d.name for d in plain.deployments] == ["llamacpp"] and plain.cache is None


def test_a_cache_section_left_empty_turns_the_cache_on_with_its_defaults(tmp_path):
    """`cache:` with every line under it commented out is YAML's null: like any section left empty, its defaults
    (configuration.md), not "no cache"."""
    from server.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - id: m\n    endpoint: /v1/chat/completions\n    provider: {kind: llamacpp}\n"
                    "    cache:\n      # ttl_seconds: 60\n")
    cache = load_config(path).models[0].cache
    assert cache is not None and (cache.ttl_seconds, cache.max_entry_bytes, cache.shared) == (300, 1024 * 1024, False)


@pytest.mark.parametrize(("entry", "message"), [
    ("provider: {kind: llamacpp}, deployments: []", "not both"),
    ("deployments: []", "non-empty list"),
    ("deployments: [{name: a, provider: {kind: llamacpp}}, {name: a, provider: {kind: llamacpp}}]", "unique"),
    ("deployments: [{name: 'a b', provider: {kind: llamacpp}}]", r"deployments\[0\].name"),
    ("deployments: [{name: a, weight: 0, provider: {kind: llamacpp}}]", "weight: a positive number"),
    ("deployments: [{name: a}]", "`provider` is required"),
    ("provider: {kind: llamacpp}, health: {failure_rate: 2}", "failure_rate"),
    ("provider: {kind: llamacpp}, health: {cooldown: 2}", "unknown setting"),
    # Nothing would honour it: a model's only deployment is never taken out of service.
    ("provider: {kind: llamacpp}, health: {consecutive_failures: 2}", r"health: .*two or more deployments"),
    ("deployments: [{name: a, provider: {kind: llamacpp}}], health: {}", r"health: .*two or more deployments"),
    ("provider: {kind: llamacpp}, cache: {ttl_seconds: -1}", "ttl_seconds: a positive number"),
    ("provider: {kind: llamacpp}, cache: {shared: 1}", "shared: true or false"),
    # Redis refuses such an expiry: every answer would go unstored, logged as Redis not answering.
    ("provider: {kind: llamacpp}, cache: {ttl_seconds: 1.0e+300}", r"ttl_seconds: at most a year \(31536000\)"),
])
def test_deployment_mistakes_are_named(tmp_path, entry, message):
    from server.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, entry)
