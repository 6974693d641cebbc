"""The catalog's typed values: the models Portico serves, what serves each (deployments, their upstreams and
timeouts), what a request costs, and each model's health and cache settings. Read from the configuration by
server/config.py, server/config_providers.py and server/config_deployments.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.domain import Endpoint


@dataclass(frozen=True, slots=True)
class Timeouts:
    """An upstream's timeouts, in seconds. Read from the configuration by server/config.py and
    server/config_providers.py, as everything here."""

    connect: float = 5.0  # to open a connection
    read: float = 60.0  # for the first byte of a streamed answer, and then between any two bytes of it
    # For a whole non-streamed answer: it arrives in one piece when the model has finished, so it needs as long as
    # the longest generation takes, not just the first token.
    answer: float = 600.0
    pool: float = 10.0  # for a free pooled connection when all `max_connections` are busy


@dataclass(frozen=True, slots=True)
class RetrySettings:
    attempts: int = 3  # tries in all, the first included; 1 = no retries
    initial_backoff: float = 0.5  # seconds before the second try; doubled for each further one, with full jitter
    max_backoff: float = 8.0
    total_seconds: float = 30.0  # no try starts, and no wait runs, past this long after the first try began
    on_status: tuple[int, ...] = (429, 500, 502, 503, 529)  # besides connection errors before the answer


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    # As each dialect's SDK takes it: with /v1 for OpenAI-compatible servers (http://127.0.0.1:8000/v1), without
    # for Anthropic (https://api.anthropic.com; requests go to {base_url}/v1/messages).
    base_url: str
    model: str  # the upstream's own model name
    api_key_env: str | None = None  # None: the upstream needs no key (a local llama.cpp or vLLM server)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetrySettings = field(default_factory=RetrySettings)
    max_connections: int = 100  # pooled keep-alive connections to this upstream
    max_tokens_field: str = "max_tokens"  # OpenAI-compatible: where the token limit goes


@dataclass(frozen=True, slots=True)
class ProviderSpec:
    kind: str
    upstream: UpstreamSpec | None = None  # for the upstream kinds (openai, anthropic)


@dataclass(frozen=True, slots=True)
class Price:
    """What a model costs. Token prices are micro-dollars per million tokens (= USD per token x 10^12); read from
    a model entry's `price:` by server/usage/money.py."""

    input: int = 0
    output: int = 0
    cached_input: int = 0  # input tokens read from the provider's prompt cache
    image: int = 0  # micro-dollars per generated image
    cache_write: int = 0  # input tokens written to the provider's prompt cache (Anthropic bills them above input)
    cache_write_1h: int = 0  # those written to it for an hour (Anthropic's `ttl: 1h`, billed above cache_write)
    web_search: int = 0  # micro-dollars per search of an upstream's web search tool (Anthropic's server tool)

    @property
    def free(self) -> bool:
        return self == FREE

    def cost(self, input_tokens: int = 0, output_tokens: int = 0, cached_input_tokens: int = 0,
             images: int = 0, cache_write_tokens: int = 0, cache_write_1h_tokens: int = 0,
             web_searches: int = 0) -> int:
        """Micro-dollars, rounded up once. `input_tokens` counts every prompt token, those read from (cached) and
        written to (cache_write) the provider's prompt cache included; `cache_write_1h_tokens` are the part of the
        writes made for an hour; `web_searches` are billed per search."""
        cached = min(max(cached_input_tokens, 0), input_tokens)
        written = min(max(cache_write_tokens, 0), input_tokens - cached)
        hour = min(max(cache_write_1h_tokens, 0), written)
        per_million = ((input_tokens - cached - written) * self.input + cached * self.cached_input
                       + (written - hour) * self.cache_write + hour * self.cache_write_1h
                       + output_tokens * self.output)
        return -(-per_million // 1_000_000) + images * self.image + max(web_searches, 0) * self.web_search

    def most(self, prompt_tokens: int, output_tokens: int) -> int:
        """The most a request may cost: every prompt token at the dearest of input and cache writes (either TTL).
        Not its web searches: how many the model makes is unknown before it runs (a budget may be overshot by them)."""
        written = prompt_tokens if max(self.cache_write, self.cache_write_1h) > self.input else 0
        hour = written if self.cache_write_1h >= self.cache_write else 0
        return self.cost(prompt_tokens, output_tokens, cache_write_tokens=written, cache_write_1h_tokens=hour)


FREE = Price()  # nothing to pay: a model without a `price:`, a cached answer


@dataclass(frozen=True, slots=True)
class Deployment:
    """One of the providers serving a model (server/config_deployments.py reads them)."""

    name: str  # unique within its model: a metrics label and the /readyz detail
    provider: ProviderSpec
    weight: float = 1.0  # share of the model's requests, relative to its other deployments


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """When a deployment is taken out of service (models with two or more deployments; server/providers/health.py)."""

    consecutive_failures: int = 3  # this many failures in a row eject it
    failure_rate: float = 0.5  # ... or this share of failures over the window
    window_seconds: float = 30.0
    min_requests: int = 10  # the rate is only judged over at least this many requests in the window
    cooldown_seconds: float = 5.0  # the first ejection; doubled for each one that follows a failed trial
    max_cooldown_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """A model's response cache (server/cache/)."""

    ttl_seconds: float = 300.0
    max_entry_bytes: int = 1024 * 1024  # larger answers are not cached
    shared: bool = False  # True: keys that send the same request share answers; False: each key id has its own
    # What serves the model (server/config_deployments.py, with_cache_serving): part of every cache key, so an
    # answer kept before the model moved to another upstream is not given after it, by any host or restart.
    serving: str = ""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    id: str
    endpoint: Endpoint
    owned_by: str
    created: int
    deployments: tuple[Deployment, ...]  # one or more
    fallbacks: tuple[str, ...] = ()  # model ids tried in order when this model's provider fails in a retryable way
    price: Price = field(default_factory=Price)  # what a request costs (server/usage/money.py); free when unset
    health: HealthSettings = field(default_factory=HealthSettings)
    cache: CacheSettings | None = None  # None: answers are never cached

    @property
    def provider(self) -> ProviderSpec:
        """The first deployment's provider (what a model with one deployment is served by)."""
        return self.deployments[0].provider
