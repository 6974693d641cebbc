"""The admin catalog (GET /v1/admin/models): what serves each model, in the units operators read."""

from __future__ import annotations

from server.domain import Deployment, Endpoint, KeyLimits, ModelEntry, Price, ProviderSpec, UpstreamSpec
from server.services.model_admin import _model_to_pb


def test_an_upstream_model_shows_its_upstream_name_fallbacks_price_in_usd_and_limits():
    entry = ModelEntry(
        "family-a-5.5", Endpoint.CHAT, "portico", 1_700_000_000,
        (Deployment("openai", ProviderSpec("openai", UpstreamSpec("http://127.0.0.1:9/v1", "gpt-x",
                                                                  api_key_env="UPSTREAM_KEY"))),),
        fallbacks=("family-a-5.4",), price=Price(input=2_500_000, output=10_000_000),
    )
    model = _model_to_pb(entry, KeyLimits(requests_per_minute=60))
    assert (model.id, model.endpoint, model.provider, model.upstream_model) == (
        "family-a-5.5", "/v1/chat/completions", "openai", "gpt-x")
    assert list(model.fallbacks) == ["family-a-5.4"]
    assert (model.price.input, model.price.output, model.price.image) == (2.5, 10.0, 0.0)  # USD per 1M tokens
    assert model.limits.requests_per_minute == 60 and not model.limits.HasField("tokens_per_minute")
    assert "UPSTREAM_KEY" not in str(model) and "127.0.0.1" not in str(model)  # no upstream secrets or addresses


def test_an_embedded_model_has_no_upstream_and_no_limits_of_its_own():
    entry = ModelEntry("family-b-opus-4-8", Endpoint.MESSAGES, "portico", 0,
                       (Deployment("llamacpp", ProviderSpec("llamacpp")),))
    model = _model_to_pb(entry, None)
    assert model.provider == "llamacpp" and model.upstream_model == "" and not model.HasField("limits")
