"""Configurations that point models at test upstreams, and reading what the limits settled."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from server.app import RunningServer, start_server
from server.config import Config, load_config

UPSTREAM_KEY_ENV = "PORTICO_TEST_UPSTREAM_KEY"
UPSTREAM_KEY = "sk-test-upstream-0123456789"  # must never show up in an answer or a log
FAST_RETRY = "{attempts: 3, initial_backoff: 0.02, max_backoff: 0.1, total_seconds: 5}"


def write_config(directory: Path, models_yaml: str, *, data_dir: Path | None = None) -> Path:
    """A config file with these `models:` (YAML list items, indented by two spaces)."""
    path = directory / "portico.yaml"
    data = data_dir or directory / "data"
    path.write_text(f"data_dir: {data}\nmodels:\n{models_yaml}")
    return path


def double_providers(url: str) -> tuple[str, str]:
    """The provider (a YAML flow mapping) of an OpenAI-compatible model `gpt-up` and of an Anthropic model `claude-up`,
    both on the upstream double at `url` (its `/v1` URL), tried once."""
    gpt = f"{{kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up, retry: {{attempts: 1}}}}"
    claude = (f"{{kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}, "
              "model: claude-up, retry: {attempts: 1}}")
    return gpt, claude


def cross_dialect_models(url: str, *, openai_model: str, anthropic_model: str) -> str:
    """Each dialect served by each upstream kind, all on one upstream double at `url` (its `/v1` URL): chat-on-openai,
    chat-on-anthropic, messages-on-anthropic, messages-on-openai."""
    anthropic = f"kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    openai = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    return f"""\
  - {{id: chat-on-openai, endpoint: /v1/chat/completions,
      provider: {{{openai}, model: {openai_model}, retry: {FAST_RETRY}}}}}
  - {{id: chat-on-anthropic, endpoint: /v1/chat/completions,
      provider: {{{anthropic}, model: {anthropic_model}, retry: {FAST_RETRY}}}}}
  - {{id: messages-on-anthropic, endpoint: /v1/messages,
      provider: {{{anthropic}, model: {anthropic_model}, retry: {FAST_RETRY}}}}}
  - {{id: messages-on-openai, endpoint: /v1/messages,
      provider: {{{openai}, model: {openai_model}, retry: {FAST_RETRY}}}}}
"""


def upstream_models(url: str, *, kind: str = "openai", endpoint: str = "/v1/chat/completions") -> str:
    """The models the fault tests use, all on one upstream double at `url`."""
    common = f"kind: {kind}, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    return f"""\
  - id: up-main
    endpoint: {endpoint}
    provider: {{{common}, model: main-model, retry: {FAST_RETRY}}}
    fallbacks: [up-backup]
  - id: up-backup
    endpoint: {endpoint}
    provider: {{{common}, model: backup-model, retry: {{attempts: 1}}}}
  - id: up-solo
    endpoint: {endpoint}
    provider: {{{common}, model: solo-model, retry: {FAST_RETRY}}}
  - id: up-slow
    endpoint: {endpoint}
    provider: {{{common}, model: slow-model, timeouts: {{read: 0.5, answer: 1.0}}, retry: {{attempts: 1}}}}
  - id: up-down
    endpoint: {endpoint}
    provider: {{{common.replace(url, 'http://127.0.0.1:9/v1')}, model: nowhere, retry: {FAST_RETRY}}}
    fallbacks: [up-backup]
  - id: up-chain
    endpoint: {endpoint}
    provider: {{{common}, model: chain-model, retry: {{attempts: 1}}}}
    fallbacks: [embedded, up-backup]
  - id: embedded
    endpoint: {endpoint}
    provider: {{kind: llamacpp}}
"""


def load_upstream_config(directory: Path, models_yaml: str) -> Config:
    return load_config(write_config(directory, models_yaml))


@asynccontextmanager
async def upstream_server(directory: Path, models_yaml: str) -> AsyncIterator[RunningServer]:
    """An in-process server on 127.0.0.1:0 whose models point at test upstreams, with the upstream key set."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    server = await start_server(load_upstream_config(directory, models_yaml), "127.0.0.1:0")
    try:
        yield server
    finally:
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def window_tokens(running, key_id: str) -> int:
    """Tokens the key's per-minute window holds: what its requests were settled with (the in-process store)."""
    counters = running.limiter.store._scopes.get(key_id)
    return counters.window_tokens if counters else 0
