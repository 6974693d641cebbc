"""The `usage:` section of the configuration: how the ledger is written and kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.config_providers import ConfigError, known_settings, number, optional_mapping


@dataclass(frozen=True, slots=True)
class UsageSettings:
    flush_seconds: float = 1.0  # rows are written at least this often ...
    batch_rows: int = 500  # ... or as soon as this many are waiting
    buffer_rows: int = 100_000  # rows held while the store cannot be written; beyond this they are dropped (counted)
    retention_days: int = 400  # rows older than this are deleted; 0 keeps them forever


def parse_usage(raw: Any, where: str) -> UsageSettings:
    raw = optional_mapping(raw, where)
    known = {"flush_seconds", "batch_rows", "buffer_rows", "retention_days"}
    known_settings(raw, sorted(known), where)
    # Whole numbers where whole numbers are meant: int() made `retention_days: 0.5` 0 (keep forever), silently.
    batch_rows = number(raw, "batch_rows", 500, where, integer=True, low=1)
    settings = UsageSettings(
        flush_seconds=number(raw, "flush_seconds", 1.0, where, positive=True),
        batch_rows=batch_rows,
        buffer_rows=number(raw, "buffer_rows", 100_000, where, integer=True, low=batch_rows),
        retention_days=number(raw, "retention_days", 400, where, integer=True, low=0),  # 0: keep forever
    )
    return settings
