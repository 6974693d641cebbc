"""Every model's provider, built once at start-up from the configuration.

One object per backend: models served by the embedded model share it, and models on one upstream server (same
base URL, key and connection settings) share one pooled HTTP client, each with its own upstream model name.
A model served by an upstream, by several deployments or with `fallbacks` is served through a Router
(server/providers/router.py), which tries its deployments, retries and fallbacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import Config
from server.config_providers import ConfigError, upstream_keys
from server.cutoff import Cutoff
from server.domain import Endpoint
from server.domain_models import Deployment, ModelEntry, UpstreamSpec
from server.observability import UpstreamRecorder
from server.providers import Provider
from server.providers.anthropic_http import AnthropicProvider, anthropic_auth_headers
from server.providers.dev_image import DevImageProvider
from server.providers.health import Board, FileBoard, MemoryBoard
from server.providers.http_upstream import HttpUpstream
from server.providers.images import ImageProvider
from server.providers.openai_http import OpenAIProvider, openai_auth_headers
from server.providers.openai_images_http import OpenAIImageProvider
from server.providers.retry import ONE_TRY
from server.providers.retry_log import RetryLog
from server.providers.router import DeploymentRoute, Route, Router

if TYPE_CHECKING:
    from server.providers.llamacpp import LlamaCppProvider

AnyProvider = Provider | ImageProvider


def build_providers(
    config: Config, recorder: UpstreamRecorder | None = None, environ: Mapping[str, str] = os.environ,
    health_file: Path | None = None, cutoff: Cutoff | None = None,
) -> tuple[dict[str, AnyProvider], Board]:
    """model id -> provider, and the health board of the deployments it watches. Upstream keys are read first, so a
    missing one stops start-up before anything (the embedded model, connection pools) has been built. Retries,
    fallbacks and attempts are reported to `recorder`. `health_file`: the board shared by the worker processes of
    this host (server/providers/health.py); None: this process's own. `cutoff`: the pipeline's, which lets a
    generation whose caller left run on (server/cutoff.py); None: one of their own, under which none does."""
    keys = upstream_keys(config.models, environ)
    cutoff = cutoff or Cutoff()
    builder = _Builder(config, recorder, cutoff)
    watched = [(entry, d) for entry in config.models if len(entry.deployments) > 1 for d in entry.deployments]
    names = [(entry.id, d.name, entry.health) for entry, d in watched]
    board = FileBoard(health_file, names) if health_file is not None else MemoryBoard(names)
    slots = {(entry.id, d.name): slot for slot, (entry, d) in enumerate(watched)}
    routes = {entry.id: Route(entry.id, tuple(
        DeploymentRoute(d.name, d.weight, builder.provider(entry, d, keys.get((entry.id, d.name))),
                        d.provider.upstream.retry if d.provider.upstream is not None else ONE_TRY,
                        slots.get((entry.id, d.name)))
        for d in entry.deployments)) for entry in config.models}
    providers: dict[str, AnyProvider] = {}
    in_flight: dict[tuple[str, str], int] = {}  # one count per deployment, whichever model's request runs on it
    retry_log = RetryLog()  # one line a minute per kind, whichever model's request met it
    for entry in config.models:
        own = routes[entry.id].deployments
        if not entry.fallbacks and len(own) == 1 and entry.provider.upstream is None:
            providers[entry.id] = own[0].provider  # nothing to retry or fall back to: the provider itself
        else:
            chain = [routes[model_id] for model_id in (entry.id, *entry.fallbacks)]
            providers[entry.id] = Router(chain, board=board, recorder=recorder, caller_left=cutoff.caller_left,
                                         in_flight=in_flight, retry_log=retry_log)
    return providers, board


class _Builder:
    def __init__(self, config: Config, recorder: UpstreamRecorder | None, cutoff: Cutoff) -> None:
        self._config = config
        self._recorder = recorder
        self._cutoff = cutoff
        self._embedded: LlamaCppProvider | None = None
        self._dev_image = DevImageProvider(recorder)  # holds nothing, so building it unused costs nothing
        self._upstreams: dict[tuple, HttpUpstream] = {}

    def provider(self, entry: ModelEntry, deployment: Deployment, key: str | None) -> AnyProvider:
        kind = deployment.provider.kind
        if kind == "dev-image":
            return self._dev_image
        if kind == "llamacpp":
            return self._llamacpp()
        spec = deployment.provider.upstream
        assert spec is not None
        upstream = self._upstream(kind, spec, key)
        if entry.endpoint is Endpoint.IMAGES:
            return OpenAIImageProvider(upstream, spec, model_id=entry.id)
        if kind == "anthropic":
            return AnthropicProvider(upstream, spec, model_id=entry.id)
        return OpenAIProvider(upstream, spec, model_id=entry.id)

    def _llamacpp(self) -> LlamaCppProvider:
        if self._embedded is None:
            # Imported only when a model needs it: llama_cpp (with numpy and jinja2) adds ~30 MB to every server
            # process, which a gateway in front of upstreams only would carry for nothing.
            from server.providers.llamacpp import LlamaCppProvider

            settings = self._config.embedded
            path = settings.model_path or LlamaCppProvider.default_model_path()
            try:
                self._embedded = LlamaCppProvider(
                    path,
                    n_ctx=settings.context_size,
                    n_threads=settings.threads,
                    n_instances=settings.instances,
                    recorder=self._recorder,
                )
            except (ValueError, MemoryError) as exc:  # llama.cpp cannot load the file, or make a context that size
                if isinstance(exc, ValueError) and str(path) in str(exc):
                    raise ConfigError(f"embedded.model_path: {exc}") from None
                # Its KV cache could not be allocated ("llama_context"), or llama-cpp-python's token buffer of
                # context_size (MemoryError, where nothing overcommits).
                if isinstance(exc, MemoryError) or "llama_context" in str(exc):
                    raise ConfigError(f"embedded.context_size: llama.cpp cannot make a context of "
                                      f"{settings.context_size} tokens ({exc})") from None
                raise ConfigError(f"embedded: {exc}") from None
        return self._embedded

    def _upstream(self, kind: str, spec: UpstreamSpec, key: str | None) -> HttpUpstream:
        shared_by = (kind, spec.base_url, spec.api_key_env, spec.timeouts, spec.max_connections, spec.retry.on_status)
        if shared_by not in self._upstreams:
            headers = anthropic_auth_headers(key) if kind == "anthropic" else openai_auth_headers(key)
            self._upstreams[shared_by] = HttpUpstream(
                spec, auth_headers=headers, secret=key, provider=kind, recorder=self._recorder,
                outlast=self._cutoff.outlast)
        return self._upstreams[shared_by]
