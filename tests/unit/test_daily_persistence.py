"""With the in-process limit store, a restart does not refund the day's quota (nor the month's budget)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from server.domain_keys import KeyLimits
from server.errors import RateLimited
from server.limits import Demand, MemoryLimitStore, Scope
from server.limits.daily_file import load_daily
from tests.limits_support import NOON, FakeClock


def daily(requests: int) -> Demand:
    return Demand((Scope("k1", "key k1", KeyLimits(daily_requests=requests, daily_tokens=1000)),), 10)


async def test_the_days_counters_survive_a_restart(tmp_path):
    state, clock = tmp_path / "limits-daily.json", FakeClock(NOON)
    first = MemoryLimitStore(clock, state_path=state)
    for _ in range(2):
        await first.settle(await first.reserve(daily(3)), 25)
    await first.close()  # as at shutdown

    again = MemoryLimitStore(clock, state_path=state)
    counts = await again.counts("k1")
    assert (counts.day_requests, counts.day_tokens) == (2, 50)
    await again.reserve(daily(3))
    with pytest.raises(RateLimited):  # the quota of 3 a day was not refunded by the restart
        await again.reserve(daily(3))
    await again.close()

    clock.advance(24 * 3600)  # a new UTC day starts afresh, as always
    tomorrow = MemoryLimitStore(clock, state_path=state)
    assert (await tomorrow.counts("k1")).day_requests == 0
    await tomorrow.close()


async def test_counters_are_saved_while_running_not_only_at_shutdown(tmp_path):
    state = tmp_path / "limits-daily.json"
    store = MemoryLimitStore(FakeClock(NOON), state_path=state, save_every_s=0.02)
    await store.settle(await store.reserve(daily(5)), 10)
    await asyncio.sleep(0.2)
    assert (await MemoryLimitStore(FakeClock(NOON), state_path=state).counts("k1")).day_requests == 1  # a crash now
    await store.close()


async def test_a_request_running_at_a_crash_counts_as_its_ledger_row_says(tmp_path):
    """One request, nothing used: it was saved with its estimates (prompt + max tokens, the most it could cost), which
    a start after `kill -9` kept for the rest of the day and month."""
    state = tmp_path / "limits-daily.json"
    scope = Scope("k1", "key k1", KeyLimits(daily_tokens=100_000, max_spend_day=10**6, max_spend_month=10**6))
    store = MemoryLimitStore(FakeClock(NOON), state_path=state, save_every_s=0.02)
    await store.settle(await store.reserve(Demand((scope,), 30, 40)), 20, 25)
    await store.reserve(Demand((scope,), 50_000, 9_000))  # running when the process is killed
    await asyncio.sleep(0.2)
    counts = await MemoryLimitStore(FakeClock(NOON), state_path=state).counts("k1")
    assert (counts.day_requests, counts.day_tokens, counts.day_spend, counts.month_spend) == (2, 20, 25, 25)
    await store.close()


def test_an_unreadable_file_starts_the_day_afresh(tmp_path):
    state = tmp_path / "limits-daily.json"
    state.write_text("{not json")
    assert MemoryLimitStore(state_path=state)._scopes == {}


async def test_counters_a_full_disk_kept_from_the_file_are_saved_once_it_has_room(tmp_path, caplog):
    """While the file could not be written (a full disk), the store took its counters as saved: once the disk had
    room they stayed unsaved until the next request, so a crash of an idle gateway refunded the day's quota. Every
    2 s of the outage also logged the same error again."""
    state = tmp_path / "limits-daily.json"
    blocker = tmp_path / "limits-daily.json.partial"
    blocker.mkdir()  # every write of the file fails, as on a full disk
    store = MemoryLimitStore(FakeClock(NOON), state_path=state, save_every_s=0.02)
    with caplog.at_level(logging.WARNING, logger="server.limits.memory"):
        await store.settle(await store.reserve(daily(5)), 10)
        await asyncio.sleep(0.1)
        await store.settle(await store.reserve(daily(5)), 10)
        await asyncio.sleep(0.1)
        assert [r.levelname for r in caplog.records] == ["ERROR"]  # said once, not every 2 s
        blocker.rmdir()  # room again; no request comes
        await asyncio.sleep(0.1)
    assert (await MemoryLimitStore(FakeClock(NOON), state_path=state).counts("k1")).day_requests == 2  # a crash now
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]
    await store.close()


async def test_scopes_that_count_nothing_any_more_are_forgotten(tmp_path):
    """Every key that ever made a request kept its counters for good, in memory and in the file saved every 2 s (and
    read back at each start): a gateway whose keys come and go grew without bound. Once a scope counts nothing (no
    request in its minute or in flight, nothing today, no spend this month), it is dropped, as Redis expires idle
    ones."""
    state, clock = tmp_path / "limits-daily.json", FakeClock(NOON)
    store = MemoryLimitStore(clock, state_path=state, save_every_s=0.02)
    limits = KeyLimits(requests_per_minute=100, max_spend_month=10**6)
    for n in range(300):  # free requests
        await store.settle(await store.reserve(Demand((Scope(f"old{n}", "key", limits),), 10)), 5)
    await store.settle(await store.reserve(Demand((Scope("spender", "key", limits),), 10, 40)), 5, 30)
    running = await store.reserve(Demand((Scope("running", "key", limits),), 10))
    clock.advance(24 * 3600)  # the next day, the same month
    await store.settle(await store.reserve(Demand((Scope("today", "key", limits),), 10)), 5)
    await asyncio.sleep(0.1)
    assert set(load_daily(state)) == {"spender", "running", "today"}
    assert (await store.counts("old7")).day_requests == 0  # a forgotten scope reads as a new one
    await store.settle(running, 5)
    await store.close()


def test_the_saved_counters_are_private_whatever_a_crash_left_beside_them(tmp_path):
    """limits-daily.json names every key with its day's use. It is written beside (`.partial`) and renamed: a
    `.partial` a crash left readable by others (an older version's, or a copy an operator made) kept its mode when
    written again, so the file renamed over limits-daily.json was readable by every user until the next start.
    Whatever was there, the file saved is the service user's alone."""
    import os
    import stat

    from server.limits.daily_file import save_daily

    path = tmp_path / "limits-daily.json"
    left = path.with_name(path.name + ".partial")
    left.write_bytes(b"{}")
    left.chmod(0o644)
    previous = os.umask(0o077)  # as every Portico process runs
    try:
        save_daily(path, {"key_1": (1, 2, 3, 4, 5, 6)})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_daily(path) == {"key_1": (1, 2, 3, 4, 5, 6)}
