"""Every model's provider, built once at start-up from the configuration.

One object per backend: models served by the embedded model share it, and models on one upstream server (same
base URL, key and connection settings) share one pooled HTTP client, each with its own upstream model name.
Upstream providers are wrapped in retries, and a model with `fallbacks` in its chain.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from server.config import Config
from server.config_providers import upstream_keys
from server.domain import Endpoint, ModelEntry, UpstreamSpec
from server.observability import UpstreamRecorder
from server.providers import Provider
from server.providers.anthropic_http import AnthropicProvider, anthropic_auth_headers
from server.providers.dev_image import DevImageProvider
from server.providers.fallback import FallbackImageProvider, FallbackProvider
from server.providers.http_upstream import HttpUpstream
from server.providers.images import ImageProvider
from server.providers.openai_http import OpenAIProvider, openai_auth_headers
from server.providers.openai_images_http import OpenAIImageProvider
from server.providers.retry import RetryingImageProvider, RetryingProvider

if TYPE_CHECKING:
    from server.providers.llamacpp import LlamaCppProvider

AnyProvider = Provider | ImageProvider


def build_providers(
    config: Config, recorder: UpstreamRecorder | None = None, environ: Mapping[str, str] = os.environ
) -> dict[str, AnyProvider]:
    """model id -> provider. Upstream keys are read first, so a missing one stops start-up before anything
    (the embedded model, connection pools) has been built. Retries and fallbacks are reported to `recorder`."""
    keys = upstream_keys(config.models, environ)
    builder = _Builder(config, recorder)
    own = {entry.id: builder.provider(entry, keys.get(entry.id)) for entry in config.models}
    providers: dict[str, AnyProvider] = {}
    for entry in config.models:
        chain = [(model_id, own[model_id]) for model_id in (entry.id, *entry.fallbacks)]
        if not entry.fallbacks:
            providers[entry.id] = own[entry.id]
        elif entry.endpoint is Endpoint.IMAGES:
            providers[entry.id] = FallbackImageProvider(chain, recorder=recorder)
        else:
            providers[entry.id] = FallbackProvider(chain, recorder=recorder)
    return providers


class _Builder:
    def __init__(self, config: Config, recorder: UpstreamRecorder | None) -> None:
        self._config = config
        self._recorder = recorder
        self._embedded: LlamaCppProvider | None = None
        self._dev_image = DevImageProvider()  # holds nothing, so building it unused costs nothing
        self._upstreams: dict[tuple, HttpUpstream] = {}

    def provider(self, entry: ModelEntry, key: str | None) -> AnyProvider:
        kind = entry.provider.kind
        if kind == "dev-image":
            return self._dev_image
        if kind == "llamacpp":
            return self._llamacpp()
        spec = entry.provider.upstream
        assert spec is not None
        upstream = self._upstream(kind, spec, key)
        if entry.endpoint is Endpoint.IMAGES:
            images = OpenAIImageProvider(upstream, spec, model_id=entry.id)
            return RetryingImageProvider(images, spec.retry, model_id=entry.id, recorder=self._recorder)
        if kind == "anthropic":
            provider = AnthropicProvider(upstream, spec, model_id=entry.id)
        else:
            provider = OpenAIProvider(upstream, spec, model_id=entry.id)
        return RetryingProvider(provider, spec.retry, model_id=entry.id, recorder=self._recorder)

    def _llamacpp(self) -> LlamaCppProvider:
        if self._embedded is None:
            # Imported only when a model needs it: llama_cpp (with numpy and jinja2) adds ~30 MB to every server
            # process, which a gateway in front of upstreams only would carry for nothing.
            from server.providers.llamacpp import LlamaCppProvider

            settings = self._config.embedded
            self._embedded = LlamaCppProvider(
                settings.model_path or LlamaCppProvider.default_model_path(),
                n_ctx=settings.context_size,
                n_threads=settings.threads,
                n_instances=settings.instances,
                recorder=self._recorder,
            )
        return self._embedded

    def _upstream(self, kind: str, spec: UpstreamSpec, key: str | None) -> HttpUpstream:
        shared_by = (kind, spec.base_url, spec.api_key_env, spec.timeouts, spec.max_connections, spec.retry.on_status)
        if shared_by not in self._upstreams:
            headers = anthropic_auth_headers(key) if kind == "anthropic" else openai_auth_headers(key)
            self._upstreams[shared_by] = HttpUpstream(spec, auth_headers=headers, secret=key, provider=kind,
                                                      recorder=self._recorder)
        return self._upstreams[shared_by]
