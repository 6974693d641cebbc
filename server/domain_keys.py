"""The values of API keys: a stored key (`ApiKey`, its secret never held, only its hash stored), its limits
(`KeyLimits`) and the bounds every way of setting them shares (the largest count and budget, a rotation's longest
grace). Apart from server/domain.py (the values of generation), which they share nothing with."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field, fields

_KEY_ID = re.compile(r"key_[0-9a-f]{16}")


def new_key_id() -> str:
    return f"key_{secrets.token_hex(8)}"


def is_key_id(text: str) -> bool:
    """A key store id's shape (new_key_id's): never a secret, so what an admin call names may be logged."""
    return _KEY_ID.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    daily_tokens: int | None = None
    daily_requests: int | None = None
    # Budgets in micro-dollars (1 USD = 1,000,000): spend per UTC day and per UTC calendar month.
    max_spend_day: int | None = None
    max_spend_month: int | None = None


SPEND_LIMIT_NAMES = ("max_spend_day", "max_spend_month")  # in micro-dollars here, in US dollars on every API
# A rotation's grace, at most ten years: the previous secret's end, now + grace, must fit `previous_secret_expires`
# (uint32 unix seconds, until 2106). The CLI, gRPC, REST and the configuration's default get the same bound.
MAX_GRACE_SECONDS = 10 * 365 * 86_400
# The largest limit, for a key's own and the configuration's defaults and per-model limits alike. Counts: what the
# APIs' int32 fields hold (a bigger one, stored through the CLI, would break every listing of the key). Budgets, in
# micro-dollars: a billion US dollars, exact in the stores' 64-bit columns and in the doubles of the Redis limit
# scripts (below 2**53).
MAX_COUNT_LIMIT = 2**31 - 1
MAX_SPEND_LIMIT = 1_000_000_000 * 1_000_000
KEY_LIMIT_NAMES = tuple(f.name for f in fields(KeyLimits))
# What a limit counts on: the key, or the key on one model (limits.models); a metric label.
LIMIT_SCOPES = ("key", "key_model")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A stored key. The secret is never held here: only its hash is stored."""

    id: str
    name: str
    all_models: bool
    models: frozenset[str]
    limits: KeyLimits = field(default_factory=KeyLimits)
    env: str = ""
    admin: bool = False
    created: int = 0
    revoked_at: int = 0
    # Found by a rotated-out secret: when that secret stops working (unix seconds; 0 for the current secret). Not
    # part of the key's identity: the same key, found by either secret.
    secret_expires: int = field(default=0, compare=False)

    def may_use(self, model_id: str) -> bool:
        return self.all_models or model_id in self.models
