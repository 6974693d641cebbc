"""Money as exact integers: micro-dollars (1 USD = 1,000,000), never floats, and the prices of a model.

Prices are configured in the units providers publish (USD per million tokens, USD per image) and held as integers:
micro-dollars per million tokens and micro-dollars per image. A request's cost is the sum over its token kinds,
rounded up once to a whole micro-dollar, so every request costs an exact integer and totals are plain sums.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from server.config_providers import ConfigError, mapping, setting_names
from server.domain_models import Price

MICROS_PER_USD = 1_000_000
# The dearest price (per million tokens, or per image): with at most 2**31 tokens of each kind a request's cost stays
# far inside the ledger's BIGINT, where a dearer one (`input: 1e30`) overflowed it and blocked every later row.
MAX_PRICE_USD = 1_000_000


def usd_to_micros(value: Any, where: str = "amount", *, signed: bool = False) -> int:
    """A dollar amount given as text or a number (5, "0.15", 2.5) in whole micro-dollars; refuses anything finer
    than a micro-dollar, negative, or not a number. `signed`: a negative amount is returned, for a budget whose
    range check names its bounds (more than $0): "non-negative" told a user of -1 to try 0, refused in turn."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: a number of US dollars, not {value!r}")
    try:
        micros = Decimal(str(value)) * MICROS_PER_USD
    except InvalidOperation:
        raise ValueError(f"{where}: a number of US dollars, not {value!r}") from None
    if not micros.is_finite() or (micros < 0 and not signed):
        raise ValueError(f"{where}: must be a non-negative number of US dollars, not {value!r}")
    if micros != micros.to_integral_value():
        raise ValueError(f"{where}: {value!r} is finer than a micro-dollar (0.000001 USD)")
    return int(micros)


def micros_to_usd(micros: int) -> float:
    """For JSON answers and metrics, which carry dollars as numbers (OpenAI's `amount.value`)."""
    return micros / MICROS_PER_USD


def usd_text(micros: int) -> str:
    """"$0.0125" in messages: at least cents, more digits only when they matter."""
    text = f"{Decimal(micros) / MICROS_PER_USD:.6f}".rstrip("0")
    whole, _, fraction = text.partition(".")
    return f"${whole}.{fraction.ljust(2, '0')}"


def parse_price(raw: Any, where: str) -> Price:
    """A model entry's `price:` mapping: `input`, `output`, `cached_input`, `cache_write`, `cache_write_1h` (USD per
    million tokens; cached_input and cache_write default to input, cache_write_1h to cache_write), `image` (USD per
    image) and `web_search` (USD per search, Anthropic's web search tool)."""
    raw = mapping(raw, where)
    known = {"input", "output", "cached_input", "cache_write", "cache_write_1h", "image", "web_search"}
    if unknown := set(raw) - known:
        raise ConfigError(f"{where}: unknown setting(s) {setting_names(unknown)}; known: input, output, "
                          "cached_input, cache_write, cache_write_1h (USD per million tokens), image (USD per image), "
                          "web_search (USD per search)")
    try:
        values = {name: usd_to_micros(value, f"{where}.{name}") for name, value in raw.items() if value is not None}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for name, micros in values.items():
        if micros > MAX_PRICE_USD * MICROS_PER_USD:
            raise ConfigError(f"{where}.{name}: at most {MAX_PRICE_USD} US dollars, not {raw[name]!r}")
    values.setdefault("cached_input", values.get("input", 0))
    values.setdefault("cache_write", values.get("input", 0))
    values.setdefault("cache_write_1h", values["cache_write"])  # unset: existing prices keep their costs
    return Price(**values)
