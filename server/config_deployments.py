"""A model entry's `deployments:` (several providers serving one model, with weights), its passive `health:`
settings and its opt-in response `cache:`. Read by server/config.py; the `provider:` shape is server/config_providers.py.

A plain `provider:` is one deployment, named after its kind; `deployments:` lists several, each with a `name` (for
metrics, logs and /readyz), a `weight` and a `provider:` of the same shape.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import fields, replace
from typing import Any

from server import wire_json
from server.config_providers import (
    MAX_SECONDS, MAX_WHOLE, ConfigError, known_settings, mapping, parse_provider, setting_names,
)
from server.domain import Endpoint
from server.domain_models import CacheSettings, Deployment, HealthSettings, ModelEntry

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_deployments(raw: dict, where: str, endpoint: Endpoint) -> tuple[Deployment, ...]:
    """From a model entry: its `provider:` (one deployment) or its `deployments:` list."""
    if "provider" not in raw and "deployments" not in raw:
        raise ConfigError(f"{where}: `provider` is required (or `deployments`, a list of {{name, weight, provider}})")
    if "provider" in raw and "deployments" in raw:
        raise ConfigError(f"{where}: give either `provider` (one deployment) or `deployments` (a list), not both")
    if "provider" in raw:
        provider = parse_provider(raw["provider"], f"{where}.provider", endpoint)
        return (Deployment(name=provider.kind, provider=provider),)
    items = raw["deployments"]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}.deployments: a non-empty list of {{name, weight, provider}}")
    deployments = tuple(_deployment(item, f"{where}.deployments[{i}]", endpoint) for i, item in enumerate(items))
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.deployments: each `name` must be unique within the model")
    return deployments


def _deployment(raw: Any, where: str, endpoint: Endpoint) -> Deployment:
    raw = mapping(raw, where)
    known_settings(raw, ("name", "weight", "provider"), where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}.name: required, letters, digits, `_`, `.` or `-` (up to 64), not {name!r}")
    weight = raw.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{where}.weight: a positive number, not {weight!r}")
    if "provider" not in raw:
        raise ConfigError(f"{where}: `provider` is required")
    return Deployment(name=name, weight=float(weight), provider=parse_provider(raw["provider"], f"{where}.provider",
                                                                               endpoint))


MAX_WINDOW_SECONDS = 86400  # a day: the failure rate of longer spans says little of a deployment now


def parse_health(raw: Any, where: str) -> HealthSettings:
    values = _numbers(raw, where, HealthSettings)
    settings = HealthSettings(**values)
    if not 0 < settings.failure_rate <= 1:
        raise ConfigError(f"{where}.failure_rate: a share of requests, above 0 and at most 1, "
                          f"not {settings.failure_rate:.15g}")
    if not 1 <= settings.window_seconds <= MAX_WINDOW_SECONDS:  # its slices are numbered in the shared health file
        raise ConfigError(f"{where}.window_seconds: from 1 to {MAX_WINDOW_SECONDS} seconds, "
                          f"not {settings.window_seconds:.15g}")
    if settings.max_cooldown_seconds > MAX_SECONDS:
        raise ConfigError(f"{where}.max_cooldown_seconds: at most a year ({MAX_SECONDS}), "
                          f"not {settings.max_cooldown_seconds:.15g}")
    if settings.max_cooldown_seconds < settings.cooldown_seconds:
        default = "" if "max_cooldown_seconds" in values else " (its default)"  # a long cooldown alone is refused
        raise ConfigError(f"{where}.max_cooldown_seconds: at least cooldown_seconds "
                          f"({settings.cooldown_seconds:.15g}), not {settings.max_cooldown_seconds:.15g}{default}")
    return settings


def parse_cache(raw: Any, where: str, endpoint: Endpoint) -> CacheSettings | None:
    """None (no cache) unless the entry has `cache:` (`raw` None: it has none); `cache: {}` turns it on with the
    defaults."""
    if raw is None or raw is False:
        return None
    if endpoint is Endpoint.IMAGES:
        raise ConfigError(f"{where}: only chat and messages models can be cached")
    raw = {} if raw is True else mapping(raw, where)
    shared = raw.get("shared", False)
    if not isinstance(shared, bool):
        raise ConfigError(f"{where}.shared: true or false")
    settings = CacheSettings(shared=shared, **_numbers({k: v for k, v in raw.items() if k != "shared"}, where,
                                                       CacheSettings, skip={"shared"}))
    if settings.ttl_seconds > MAX_SECONDS:  # Redis refuses an expiry past its clock's range
        raise ConfigError(f"{where}.ttl_seconds: at most a year ({MAX_SECONDS}), not {settings.ttl_seconds!r}")
    return settings


def with_cache_serving(entries: tuple[ModelEntry, ...], embedded_model: str | None,
                       embedded_context: int) -> tuple[ModelEntry, ...]:
    """The entries, each cached one with its CacheSettings.serving: what may answer it (each deployment's kind,
    base_url, upstream model and token field, the embedded model's file and context size, and the same of its
    fallbacks). Timeouts, retries, weights and prices change no answer, so they keep the cached ones."""
    by_id = {entry.id: entry for entry in entries}

    def served_by(entry: ModelEntry) -> list:
        # The embedded model's answer ends where its window does: a larger context_size gives longer answers.
        return [[d.provider.kind, embedded_model, embedded_context] if d.provider.upstream is None else
                [d.provider.kind, d.provider.upstream.base_url, d.provider.upstream.model,
                 d.provider.upstream.max_tokens_field] for d in entry.deployments]

    def serving(entry: ModelEntry) -> str:
        chain = [served_by(entry), *(served_by(by_id[fallback]) for fallback in entry.fallbacks)]
        return hashlib.sha256(wire_json.dumps(chain)).hexdigest()

    return tuple(entry if entry.cache is None else replace(entry, cache=replace(entry.cache, serving=serving(entry)))
                 for entry in entries)


def _numbers(raw: Any, where: str, kind: type, skip: frozenset | set = frozenset()) -> dict[str, Any]:
    """The positive numbers of a settings mapping, each checked against the dataclass's default's type."""
    raw = mapping(raw if raw is not None else {}, where)
    known = {f.name: f.default for f in fields(kind) if f.name not in skip}
    if unknown := set(raw) - set(known):
        raise ConfigError(f"{where}: unknown setting(s) {setting_names(unknown)}; known: "
                          f"{', '.join(sorted([*known, *skip]))}")
    for name, value in raw.items():
        whole = isinstance(known[name], int)
        valid = isinstance(value, int) if whole else isinstance(value, (int, float))
        if isinstance(value, bool) or not valid or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{where}.{name}: a positive {'whole ' if whole else ''}number, not {value!r}")
        # The bound of every count in the file: a consecutive_failures past 2**63 broke the shared health file.
        if whole and value > MAX_WHOLE:
            raise ConfigError(f"{where}.{name}: a positive whole number, at most {MAX_WHOLE}, not {value!r}")
    return dict(raw)
