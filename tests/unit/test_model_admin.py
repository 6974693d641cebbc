"""The admin catalog (GET /v1/admin/models): what serves each model, in the units operators read."""

from __future__ import annotations

from server.domain import Endpoint
from server.domain_keys import KeyLimits
from server.domain_models import Deployment, ModelEntry, Price, ProviderSpec, UpstreamSpec
from server.services.model_admin import _model_to_pb


def upstream(model: str) -> ProviderSpec:
    return ProviderSpec("openai", UpstreamSpec("http://127.0.0.1:9/v1", model, api_key_env="UPSTREAM_KEY"))


def test_an_upstream_model_shows_its_deployments_health_fallbacks_price_in_usd_and_limits():
    entry = ModelEntry(
        "family-a-5.5", Endpoint.CHAT, "portico", 1_700_000_000,
        (Deployment("east", upstream("gpt-x"), weight=3), Deployment("west", upstream("gpt-x-mirror"))),
        fallbacks=("family-a-5.4",), price=Price(input=2_500_000, output=10_000_000, cache_write=3_125_000,
                                                  cache_write_1h=5_000_000, web_search=10_000),
    )
    model = _model_to_pb(entry, KeyLimits(requests_per_minute=60, max_spend_day=5_000_000),
                         {("family-a-5.5", "east"): "healthy", ("family-a-5.5", "west"): "ejected"})
    assert (model.id, model.endpoint, model.provider, model.upstream_model) == (
        "family-a-5.5", "/v1/chat/completions", "openai", "gpt-x")
    assert [(d.name, d.upstream_model, d.weight, d.state) for d in model.deployments] == [
        ("east", "gpt-x", 3.0, "healthy"), ("west", "gpt-x-mirror", 1.0, "ejected")]
    assert list(model.fallbacks) == ["family-a-5.4"]
    assert (model.price.input, model.price.output, model.price.image) == (2.5, 10.0, 0.0)  # USD per 1M tokens
    assert model.price.cache_write == 3.125
    assert (model.price.cache_write_1h, model.price.web_search) == (5.0, 0.01)  # per 1M tokens, per search
    assert model.limits.requests_per_minute == 60 and not model.limits.HasField("tokens_per_minute")
    assert model.limits.max_spend_day == 5.0  # budgets in US dollars, as every API shows them
    assert "UPSTREAM_KEY" not in str(model) and "127.0.0.1" not in str(model)  # no upstream secrets or addresses


def test_a_models_only_deployment_is_unwatched_and_an_embedded_model_has_no_upstream():
    only = Deployment("llamacpp", ProviderSpec("llamacpp"))
    entry = ModelEntry("family-b-opus-4-8", Endpoint.MESSAGES, "portico", 0, (only,))
    model = _model_to_pb(entry, None, {})
    assert model.provider == "llamacpp" and model.upstream_model == "" and not model.HasField("limits")
    assert [(d.name, d.state) for d in model.deployments] == [("llamacpp", "unwatched")]
