"""Upstream provider configuration: the issue's minimal form, every setting, and clear messages for mistakes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from server.cli import main
from server.config import ConfigError, load_config
from server.config_providers import upstream_key, upstream_keys
from server.domain_models import RetrySettings, Timeouts, UpstreamSpec

MINIMAL = """\
models:
  - id: family-a-5.5
    endpoint: /v1/chat/completions
    provider: {kind: openai, base_url: "http://127.0.0.1:18001/v1", api_key_env: UPSTREAM_KEY, model: mock-gpt}
"""
FULL = """\
models:
  - id: a
    endpoint: /v1/messages
    provider:
      kind: openai
      base_url: https://api.example.com/v1/
      api_key_env: EXAMPLE_KEY
      model: gpt-x
      max_tokens_field: max_completion_tokens
      max_connections: 8
      timeouts: {connect: 2, read: 90.5}
      retry: {attempts: 5, initial_backoff: 0.1, max_backoff: 2, total_seconds: 12, on_status: [429, 503]}
    fallbacks: [b]
  - id: b
    endpoint: /v1/messages
    provider: {kind: llamacpp}
"""


def load(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


def test_the_minimal_form(tmp_path):
    (entry,) = load(tmp_path, MINIMAL).models
    assert entry.provider.kind == "openai" and entry.fallbacks == ()
    assert entry.provider.upstream == UpstreamSpec(base_url="http://127.0.0.1:18001/v1", model="mock-gpt",
                                                   api_key_env="UPSTREAM_KEY")
    assert entry.provider.upstream.retry == RetrySettings()


def test_every_setting(tmp_path):
    first, second = load(tmp_path, FULL).models
    upstream = first.provider.upstream
    assert upstream.base_url == "https://api.example.com/v1"  # the trailing slash is dropped
    assert (upstream.max_tokens_field, upstream.max_connections) == ("max_completion_tokens", 8)
    assert upstream.timeouts == Timeouts(connect=2, read=90.5)
    assert upstream.retry == RetrySettings(attempts=5, initial_backoff=0.1, max_backoff=2, total_seconds=12,
                                           on_status=(429, 503))
    assert first.fallbacks == ("b",) and second.provider.upstream is None


def test_the_key_comes_from_the_environment_only():
    spec = UpstreamSpec(base_url="http://h/v1", model="m", api_key_env="K")
    assert upstream_key(spec, {"K": "sk-1"}) == "sk-1"
    with pytest.raises(ConfigError, match="environment variable K ") as caught:
        upstream_key(spec, {"K": ""})
    assert "sk-" not in str(caught.value)
    assert upstream_key(UpstreamSpec(base_url="http://h/v1", model="m"), {}) is None


def test_serve_stops_at_once_when_a_key_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("UPSTREAM_KEY", raising=False)
    (tmp_path / "c.yaml").write_text(MINIMAL)
    assert main(["--config", str(tmp_path / "c.yaml"), "--data-dir", str(tmp_path / "d"), "serve"]) == 2
    assert "UPSTREAM_KEY" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # nothing was started or created


PROVIDER = "{kind: openai, base_url: 'http://h/v1', model: m}"


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, model: m}}]", "`base_url` is required"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h'}}]", "`model` is required"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'ftp://h', model: m}}]", "http://"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "api_key_env: 'sk-live-123'}}]", "name of an environment variable"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, key: x}}]",
         "unknown setting"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "retry: {attempts: 0}}}]", "retry.attempts"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "retry: {on_status: [200]}}}]", "on_status"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "timeouts: {read: -1}}}]", "timeouts.read"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "timeouts: {idle: 1}}}]", "unknown setting"),
        # timeouts.write was accepted and documented, and used by nothing: it is refused rather than ignored.
        ("[{id: a, endpoint: /v1/messages, provider: {kind: openai, base_url: 'http://h', model: m, "
         "timeouts: {write: 30}}}]", "timeouts.write: there is no write timeout"),
        ("[{id: a, endpoint: /v1/messages, provider: {kind: llamacpp, model: m}}]", "takes no settings"),
        ("[{id: a, endpoint: /v1/chat/completions, provider: {kind: dev-image}}]", "cannot serve"),
        (f"[{{id: a, endpoint: /v1/messages, provider: {PROVIDER}, fallbacks: [b]}}]", "'b' is not a model"),
        (f"[{{id: a, endpoint: /v1/messages, provider: {PROVIDER}, fallbacks: [a]}}]", "its own fallback"),
        (f"[{{id: a, endpoint: /v1/messages, provider: {PROVIDER}, fallbacks: [b]}},"
         f" {{id: b, endpoint: /v1/chat/completions, provider: {PROVIDER}}}]", "served at /v1/chat/completions"),
        (f"[{{id: a, endpoint: /v1/messages, provider: {PROVIDER}, fallback: [b]}}]", "unknown setting"),
    ],
)
def test_mistakes_are_clear(tmp_path, models, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, f"models: {models}")


def test_the_sample_configuration_loads(monkeypatch):
    sample = load_config(Path(__file__).parents[2] / "docs" / "upstreams.sample.yaml")
    kinds = {entry.id: entry.provider.kind for entry in sample.models}
    assert set(kinds.values()) == {"openai", "anthropic", "llamacpp", "dev-image"}
    assert sample.models[0].fallbacks == ("family-a-5.4", "family-a-local")
    for name in ("UPSTREAM_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.setenv(name, "k")
    assert len(upstream_keys(sample.models)) == 7  # per deployment
    opus = next(entry for entry in sample.models if entry.id == "family-b-opus-4-8")
    assert [d.weight for d in opus.deployments] == [3.0, 1.0] and opus.cache.ttl_seconds == 300


def test_the_sample_configurations_start_command_sets_every_key_it_names():
    """The sample's header shows how to start it; a variable the file names but the command leaves out stops
    start-up (exit code 2) for whoever runs it as written."""
    path = Path(__file__).parents[2] / "docs" / "upstreams.sample.yaml"
    command = next(line for line in path.read_text().splitlines() if "portico serve --config" in line and "=" in line)
    given = set(re.findall(r"([A-Z_]+)=", command))
    named = {d.provider.upstream.api_key_env for entry in load_config(path).models for d in entry.deployments
             if d.provider.upstream is not None and d.provider.upstream.api_key_env}
    assert named <= given, f"the start command leaves out {sorted(named - given)}"



def test_the_sample_configuration_keeps_the_default_configuration_s_key_limits():
    """The sample says every setting it does not show keeps its default, server/default.yaml's; but limits.defaults
    are that file's only where a file writes them (configuration.md), so a gateway started from the sample, in
    front of upstreams that bill, gave its keys no requests, tokens or concurrency limit at all."""
    sample = load_config(Path(__file__).parents[2] / "docs" / "upstreams.sample.yaml")
    assert sample.limits.defaults == load_config().limits.defaults
    assert sample.limits.defaults.requests_per_minute is not None

def _known(tmp_path, models: str) -> set[str]:
    """The settings a section knows, as its error for an unknown one lists them."""
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, f"models: {models}")
    units = {"per", "million", "tokens", "search"}  # of "(USD per million tokens)", "(USD per search)"
    return set(re.findall(r"[a-z0-9_]+", str(refused.value).split("known: ")[1])) - units


def test_the_sample_configuration_shows_every_model_provider_and_price_setting(tmp_path):
    """configuration.md calls the sample "a commented example of every setting"; `price` (and `created`) had been
    added to the catalog without it, so whoever copied the sample found no way to write a price."""
    sample = yaml.safe_load((Path(__file__).parents[2] / "docs" / "upstreams.sample.yaml").read_text())
    entries = sample["models"]
    providers = [e["provider"] for e in entries if "provider" in e]
    providers += [d["provider"] for e in entries for d in e.get("deployments", [])]
    shown = {name for entry in entries for name in entry}
    shown |= {name for provider in providers for name in provider}
    shown |= {name for entry in entries for name in entry.get("price", {})}
    model = _known(tmp_path, "[{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, bogus: 1}]")
    provider = _known(tmp_path, "[{id: a, endpoint: /v1/messages, "
                                "provider: {kind: openai, base_url: 'http://h/v1', model: m, bogus: 1}}]")
    price = _known(tmp_path, "[{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, price: {bogus: 1}}]")
    assert model | provider | price <= shown, f"not in the sample: {sorted((model | provider | price) - shown)}"


def test_a_cached_model_s_answers_are_keyed_on_what_serves_it_not_on_how_it_is_called(tmp_path):
    def serving(text):
        return load(tmp_path, text.replace("    provider:", "    cache: {}\n    provider:")).models[0].cache.serving
    base = MINIMAL
    assert serving(base) == serving(base.replace("mock-gpt}", "mock-gpt, timeouts: {read: 5}, retry: {attempts: 1}}"))
    assert serving(base) != serving(base.replace("mock-gpt", "mock-gpt-2"))
    assert serving(base) != serving(base.replace("127.0.0.1:18001", "127.0.0.1:18002"))
