"""A clock tests can move, for the limit stores."""

from __future__ import annotations

from dataclasses import dataclass

NOON = 1_767_268_800.0  # 2026-01-01 12:00:00 UTC


@dataclass
class FakeClock:
    now: float = NOON

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
