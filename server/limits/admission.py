"""Admission: which limits apply to a request (configured defaults, the key's own values, per-model limits), and
the x-ratelimit-* headers of an admitted one. The pipeline talks to this; the store behind it only counts."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import fields

from server.config import LimitSettings
from server.domain import ApiKey, KeyLimits
from server.limits.core import Demand, LimitStore, Reservation, Scope, Standing

_logger = logging.getLogger(__name__)


def effective_limits(key: KeyLimits, defaults: KeyLimits) -> KeyLimits:
    """The key's own value for each dimension, else the configured default."""
    return KeyLimits(**{
        f.name: value if (value := getattr(key, f.name)) is not None else getattr(defaults, f.name)
        for f in fields(KeyLimits)
    })


class Limiter:
    def __init__(self, store: LimitStore, settings: LimitSettings) -> None:
        self._store = store
        self._settings = settings

    @property
    def store(self) -> LimitStore:
        return self._store

    def scopes(self, key: ApiKey, model_id: str) -> tuple[Scope, ...]:
        scopes = [Scope(key.id, f"key {key.id}", effective_limits(key.limits, self._settings.defaults))]
        if (per_model := self._settings.models.get(model_id)) is not None:
            scopes.append(Scope(f"{key.id}|{model_id}", f"key {key.id} on model {model_id}", per_model))
        return tuple(s for s in scopes if s.limits != KeyLimits())

    async def reserve(self, key: ApiKey, model_id: str, tokens: int) -> Reservation:
        """Raises RateLimited when a limit would be exceeded."""
        return await self._store.reserve(Demand(self.scopes(key, model_id), tokens))

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        await self._finish(self._store.settle(reservation, used_tokens))

    async def release(self, reservation: Reservation) -> None:
        await self._finish(self._store.release(reservation))

    async def _finish(self, work) -> None:
        # Shielded: these run on exit paths, often in a task that is being cancelled because its caller went away,
        # and must complete anyway. A failure is logged, not raised: the caller's answer is already decided.
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001
            _logger.exception("could not settle a rate-limit reservation")

    async def close(self) -> None:
        await self._store.close()


def rate_limit_headers(reservation: Reservation) -> tuple[tuple[str, str], ...]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tightest limit of each kind that applies."""
    headers: list[tuple[str, str]] = []
    for kind, standing in (("requests", reservation.requests), ("tokens", reservation.tokens)):
        if standing is not None:
            headers += _trio(kind, standing)
    return tuple(headers)


def _trio(kind: str, standing: Standing) -> list[tuple[str, str]]:
    return [
        (f"x-ratelimit-limit-{kind}", str(standing.limit)),
        (f"x-ratelimit-remaining-{kind}", str(standing.remaining)),
        (f"x-ratelimit-reset-{kind}", duration_text(standing.reset_seconds)),
    ]


def duration_text(seconds: float) -> str:
    """OpenAI's reset format (Go durations): "250ms", "12.5s", "6m0s", "2h0m0s"."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text
