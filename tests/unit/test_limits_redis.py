"""What only the Redis store does: exact limits shared by several processes, leases that outlive no crash, restarts,
and an unreachable Redis that is answered by policy, quickly, never by a hang."""

from __future__ import annotations

import asyncio
import secrets
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from server.limits import LimitSettings
from server.domain_keys import ApiKey, KeyLimits
from server.errors import RateLimited, ServiceUnavailable
from server.limits import Limiter, rate_limit_headers
from server.limits.core import Demand, LimitStoreUnavailable, Orphan, Reservation, Scope
from server.limits.redis import RedisLimitStore, redacted
from server.limits.redis_pipe import RedisPipe
from server.limits.standing import standing
from tests.limits_support import NOON, FakeClock
from tests.limits_worker import BURST, HOLD
from tests.redis_support import RedisServer, _answers_ping, start_redis


@pytest.fixture
def prefix() -> str:
    return f"test-{secrets.token_hex(4)}:"


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.limits_worker", *args], stdout=subprocess.PIPE, text=True)


def test_two_processes_200_attempts_admit_exactly_50(redis_server, prefix):
    start_at = str(time.time() + 1.5)  # both processes fire at once
    workers = [worker("burst", redis_server.url, prefix, start_at, "100") for _ in range(2)]
    admitted = [int(w.communicate(timeout=30)[0]) for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert sum(admitted) == 50


@pytest.mark.usefixtures("no_collector_pauses")
async def test_a_slot_held_for_many_leases_stays_taken_and_a_crash_frees_it_within_one(redis_server, prefix):
    """A request that outlives two leases keeps its slot (the slots set expired under it); once its process dies,
    the slot is free within a lease."""
    crashed = worker("crash", redis_server.url, prefix, "4")  # lease 1 s: held for four
    assert crashed.stdout.readline().strip() == "held"
    store = RedisLimitStore(redis_server.url, prefix=prefix)
    try:
        while crashed.poll() is None:
            with pytest.raises(RateLimited, match="concurrent requests"):
                await store.reserve(HOLD)
            await asyncio.sleep(0.2)
        died = time.monotonic()
        while True:
            try:
                await store.reserve(HOLD)
                break
            except RateLimited:
                assert time.monotonic() - died < 1.8  # its lease was 1 s (slack for a loaded machine)
                await asyncio.sleep(0.05)
    finally:
        crashed.wait(timeout=10)
        await store.close()


async def test_a_live_process_keeps_renewing_its_leases(redis_server, prefix):
    holder = RedisLimitStore(redis_server.url, prefix=prefix, lease_seconds=0.6)
    other = RedisLimitStore(redis_server.url, prefix=prefix, lease_seconds=0.6)
    try:
        held = await holder.reserve(HOLD)
        for _ in range(10):  # 3 s: five leases, and past the 2 s its slots set was first given
            await asyncio.sleep(0.3)
            with pytest.raises(RateLimited):
                await other.reserve(HOLD)
            assert await other.in_flight("held") == 1
        await holder.settle(held, 0)
        await other.reserve(HOLD)
    finally:
        await holder.close()
        await other.close()


async def test_a_live_holder_gets_back_a_slot_whose_lease_ran_out_while_redis_was_away(redis_server, prefix):
    """Redis stalled longer than a lease: the holder could not renew, and the first admission after the stall pruned
    its lease as a crashed process's. The holder is alive and still running its request, so its next renewal books
    the slot again: the limit holds from then on instead of letting one request more in for the rest of it."""
    later = [1.0]  # the other process's clock runs a lease and more ahead: the stall, without waiting for it
    holder = RedisLimitStore(redis_server.url, prefix=prefix, lease_seconds=0.6)
    other = RedisLimitStore(redis_server.url, prefix=prefix, lease_seconds=0.6, clock=lambda: time.time() + later[0])
    try:
        held = await holder.reserve(HOLD)
        await other.settle(await other.reserve(HOLD), 0)  # admitted: the held lease had run out, and was pruned
        later[0] = 0.0
        await asyncio.sleep(0.5)  # the holder renews every lease / 3
        with pytest.raises(RateLimited, match="concurrent requests"):
            await other.reserve(HOLD)
        await holder.settle(held, 0)
        await asyncio.sleep(0.5)  # a renewal after the settlement books nothing again
        await other.reserve(HOLD)
    finally:
        await holder.close()
        await other.close()


async def test_counts_survive_a_restart_of_the_process(redis_server, prefix):
    before = RedisLimitStore(redis_server.url, prefix=prefix)
    for _ in range(50):
        await before.reserve(BURST)
    await before.close()
    after = RedisLimitStore(redis_server.url, prefix=prefix)
    try:
        with pytest.raises(RateLimited, match="limit 50, used 50"):
            await after.reserve(BURST)
    finally:
        await after.close()


async def test_a_dead_process_s_reservation_is_settled_by_another_from_what_it_booked(redis_server, prefix):
    """What `booked` gave, through a spool line (JSON) and back: one request counted, its estimates and its slot
    gone, once however often it is settled."""
    scope = Scope("dead", "key dead", KeyLimits(concurrent_requests=5, daily_tokens=10_000, max_spend_day=10**6))
    dead = RedisLimitStore(redis_server.url, prefix=prefix)
    reservation = await dead.reserve(Demand((scope,), 900, 5_000))
    booked = orjson.loads(orjson.dumps(dead.booked(reservation)))
    dead._held.clear()  # it renews no lease: killed
    await dead._redis.close()
    other = RedisLimitStore(redis_server.url, prefix=prefix)
    try:
        for _ in range(2):
            await other.settle_orphan(Orphan.of(booked))
        counts = await other.counts("dead")
        assert (counts.in_flight, counts.day_requests, counts.day_tokens, counts.day_spend) == (0, 1, 0, 0)
    finally:
        await other.close()


async def test_a_dead_process_s_reservation_is_only_let_go_once_redis_took_its_settlement(redis_server, prefix):
    """The spool keeps it until then (Adopted): a drain while Redis did not answer must not let it go, or no process
    would ever settle it."""
    booked = ["gone", time.time(), ["dead"], 900, 5_000]
    let_go: list[str] = []
    unreachable = Limiter(RedisLimitStore(f"redis://127.0.0.1:{_closed_port()}/0", timeout_seconds=0.2),
                          LimitSettings())
    unreachable.settle_orphans([(booked, lambda: let_go.append("unreachable"))])
    await unreachable.close()  # a drain: its last try fails too
    reachable = Limiter(RedisLimitStore(redis_server.url, prefix=prefix), LimitSettings())
    reachable.settle_orphans([(booked, lambda: let_go.append("reachable")), (["damaged"], lambda: let_go.append("x"))])
    await reachable.close()
    assert sorted(let_go) == ["reachable", "x"]


def test_only_what_booked_gives_is_taken_for_a_reservation():
    assert Orphan.of(["r", 1.5, ["key_a", "key_a|m"], 90, 4]) == Orphan("r", 1.5, ("key_a", "key_a|m"), 90, 4)
    for damaged in (None, "r", ["r", 1.5, [], 90, 4], ["r", "x", ["k"], 90, 4], ["r", 1.5, ["k"], 90], {"r": 1}):
        assert Orphan.of(damaged) is None


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.parametrize("where", ["closed", "silent"])
async def test_unreachable_redis_fails_fast(where, silent_port):
    port = silent_port if where == "silent" else _closed_port()
    store = RedisLimitStore(f"redis://127.0.0.1:{port}/0", timeout_seconds=0.2)
    started = time.monotonic()
    with pytest.raises(LimitStoreUnavailable):
        await store.reserve(HOLD)
    assert time.monotonic() - started < 2.0  # a 0.2 s timeout: never a hang
    await store.close()


async def test_policy_when_redis_is_unreachable():
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(requests_per_minute=1))
    url = f"redis://:hunter2@127.0.0.1:{_closed_port()}/0"
    closed = Limiter(RedisLimitStore(url, timeout_seconds=0.2), LimitSettings(on_store_error="closed"))
    with pytest.raises(ServiceUnavailable) as caught:
        await closed.reserve(key, "m", 10)
    assert caught.value.retry_after > 0 and "limit store is unreachable" in caught.value.message
    assert "hunter2" not in str(caught.value.__cause__) and ":***@" in str(caught.value.__cause__)
    opened = Limiter(RedisLimitStore(url, timeout_seconds=0.2), LimitSettings(on_store_error="open"))
    admitted = await opened.reserve(key, "m", 10)
    assert not admitted.held and rate_limit_headers(admitted) == ()
    opened.settle(admitted, 5)  # nothing to settle, and no error
    await closed.close()
    await opened.close()


def test_passwords_never_reach_messages():
    assert redacted("redis://:hunter2@db:6379/0") == "redis://:***@db:6379/0"
    assert redacted("redis://user:hunter2@db/0") == "redis://user:***@db/0"
    assert redacted("redis://db:6379/0") == "redis://db:6379/0"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_a_caller_cancelled_while_the_store_decides_leaves_nothing_behind(redis_server, prefix):
    store = RedisLimitStore(redis_server.url, prefix=prefix)
    limiter = Limiter(store, LimitSettings())
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(concurrent_requests=1))
    attempt = asyncio.ensure_future(limiter.reserve(key, "m", 0))
    await asyncio.sleep(0)  # the script is on its way to Redis
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    # Whatever the cancelled attempt booked is released at once, not when its 30-second lease runs out.
    deadline = time.monotonic() + 1.0
    while True:
        try:
            await limiter.reserve(key, "m", 0)
            break
        except RateLimited:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    await limiter.close()


# The store's connection (server/limits/redis_pipe.py): one pipelined connection per process.

def _outside(redis_server) -> redis.Redis:
    """A client of our own, to act on Redis from outside the store."""
    return redis.Redis.from_url(redis_server.url)


async def test_one_connection_carries_every_call_and_callers_that_give_up_shift_no_reply(redis_server):
    pipe = RedisPipe(redis_server.url, timeout=1.0)
    outside = _outside(redis_server)
    try:
        assert await pipe.execute("PING") == b"PONG"
        clients = outside.info("clients")["connected_clients"]
        calls = [asyncio.ensure_future(pipe.execute("ECHO", f"call {i}")) for i in range(300)]
        await asyncio.sleep(0)  # every command is on its way
        for call in calls[::3]:
            call.cancel()
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for i, reply in enumerate(replies):
            assert isinstance(reply, asyncio.CancelledError) if i % 3 == 0 else reply == f"call {i}".encode()
        assert await pipe.execute("ECHO", "after") == b"after"
        assert outside.info("clients")["connected_clients"] == clients
    finally:
        await pipe.close()
        outside.close()


async def test_a_restarted_redis_is_used_again_at_once(tmp_path, prefix):
    """The store's connection is stale after a restart, and Redis has forgotten the scripts."""
    (tmp_path / "first").mkdir()
    server = start_redis(tmp_path / "first")
    store = RedisLimitStore(server.url, prefix=prefix, timeout_seconds=0.2)
    try:
        await store.reserve(BURST)
        server.stop()
        with pytest.raises(LimitStoreUnavailable):
            await store.reserve(BURST)
        server = _restart(server, tmp_path / "second")
        admitted = await store.reserve(BURST)
        assert admitted.requests.remaining == 49  # a new Redis without persistence: counts start again
        await store.settle(admitted, 0)
        assert await store.in_flight("burst") == 0
    finally:
        await store.close()
        server.stop()


def _restart(server: RedisServer, directory: Path) -> RedisServer:
    """A new redis-server on the stopped one's port."""
    directory.mkdir()
    process = subprocess.Popen(
        [shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(server.port), "--save", "",
         "--appendonly", "no", "--dir", str(directory), "--logfile", str(directory / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    restarted = RedisServer(server.port, process, directory / "redis.log")
    deadline = time.monotonic() + 10
    while not _answers_ping(server.port):
        assert process.poll() is None and time.monotonic() < deadline, "redis-server did not restart"
        time.sleep(0.02)
    return restarted


@pytest.mark.usefixtures("no_collector_pauses")
async def test_callers_share_one_attempt_to_connect_and_each_waits_only_its_own_timeout():
    """A Redis that takes connections and answers nothing (stopped, say): the handshake of each new connection
    waits out the timeout. Callers waited for a lock and made the attempt in turn, so one arriving just after a
    caller that gave up began a new attempt (a second connection) when that one's time ran out; on Python 3.11 its
    own timeout could then fire unheard, and a cache lookup cost two timeouts instead of one."""
    accepted: list[asyncio.Transport] = []

    class Silent(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.append(transport)

    server = await asyncio.get_running_loop().create_server(Silent, "127.0.0.1", 0)
    pipe = RedisPipe(f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", timeout=0.4)

    async def get(give_up_after: float) -> float:
        began = time.monotonic()
        with pytest.raises((TimeoutError, redis.exceptions.TimeoutError)):  # its own, or the attempt's
            async with asyncio.timeout(give_up_after):
                await pipe.execute("GET", "k")
        return time.monotonic() - began

    try:
        first = asyncio.create_task(get(0.1))
        await asyncio.sleep(0.05)
        waited = await get(0.4)
        assert await first < 0.3 and waited < 0.6  # each its own timeout, though the first gave up mid-attempt
        assert len(accepted) == 1  # the second caller waited on the attempt the first began
    finally:
        await pipe.close()
        for transport in accepted:
            transport.close()
        server.close()
        await server.wait_closed()


async def test_a_stalled_redis_fails_calls_in_time_and_then_serves_again(redis_server, prefix):
    store = RedisLimitStore(redis_server.url, prefix=prefix, timeout_seconds=0.2)
    outside = _outside(redis_server)
    try:
        await store.reserve(BURST)
        outside.execute_command("CLIENT", "PAUSE", 800, "ALL")
        started = time.monotonic()
        with pytest.raises(LimitStoreUnavailable, match="TimeoutError"):
            await store.reserve(BURST)
        assert time.monotonic() - started < 0.6  # 0.2 s, not the pause
        await asyncio.sleep(0.8)
        await _admitted_again(store)  # once tried again: within a second of the timeout
    finally:
        await store.close()
        outside.close()


async def test_a_busy_event_loop_is_not_mistaken_for_a_stalled_redis(redis_server):
    pipe = RedisPipe(redis_server.url, timeout=0.2)
    try:
        await pipe.execute("PING")
        # Held up before the command is written or after, a little or well past the timeout; Redis answers
        # meanwhile, and its reply is read as soon as the event loop gets to it.
        for turns, busy in ((1, 0.35), (2, 0.35), (2, 0.22)):
            await asyncio.sleep(0.25)  # the timeout is timed from this command on
            call = asyncio.ensure_future(pipe.execute("ECHO", "late"))
            for _ in range(turns):
                await asyncio.sleep(0)
            time.sleep(busy)
            assert await call == b"late"
    finally:
        await pipe.close()


async def test_a_drain_gives_a_settlement_redis_missed_its_last_try(tmp_path, prefix, monkeypatch):
    """A settlement waiting to be retried is not dropped, nor waited for, by a stopping server: it is tried at once."""
    monkeypatch.setattr("server.limits.admission._FIRST_RETRY_SECONDS", 60.0)  # longer than any drain
    server = start_redis(tmp_path)
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(daily_tokens=1000))
    limiter = Limiter(RedisLimitStore(server.url, prefix=prefix, timeout_seconds=0.2), LimitSettings())
    try:
        reservation = await limiter.reserve(key, "m", 100)
        server.process.send_signal(signal.SIGSTOP)
        try:
            limiter.settle(reservation, 30)
            await asyncio.sleep(1.0)  # its first try timed out: the next is a minute away
        finally:
            server.process.send_signal(signal.SIGCONT)
        started = time.monotonic()
        await limiter.close()
        assert time.monotonic() - started < 2.0
        fresh = RedisLimitStore(server.url, prefix=prefix)
        assert (await fresh.counts("k")).day_tokens == 30
        await fresh.close()
    finally:
        server.stop()


async def test_settlements_waiting_for_redis_are_logged_once_not_once_each(tmp_path, prefix, monkeypatch, caplog):
    """Redis frozen with 20 requests in flight: each one's settlement logged 'could not settle a rate-limit reservation
    (...); retrying' and, once Redis answered, 'settled a rate-limit reservation after N tries': 40 lines for one
    outage, as many as requests were running (hundreds on a busy host). Now one line when they begin to wait and one
    when the last is settled, with the count."""
    monkeypatch.setattr("server.limits.admission._FIRST_RETRY_SECONDS", 0.2)
    server = start_redis(tmp_path)
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(daily_tokens=100000))
    limiter = Limiter(RedisLimitStore(server.url, prefix=prefix, timeout_seconds=0.2), LimitSettings())
    try:
        reservations = [await limiter.reserve(key, "m", 100) for _ in range(20)]
        server.process.send_signal(signal.SIGSTOP)
        with caplog.at_level("INFO", logger="server.limits.admission"):
            try:
                for reservation in reservations:
                    limiter.settle(reservation, 30)
                await asyncio.sleep(1.0)
            finally:
                server.process.send_signal(signal.SIGCONT)
            await limiter.settled()
        lines = [record.getMessage() for record in caplog.records if "settl" in record.getMessage()]
        assert len(lines) == 2, lines
        assert "could not settle" in lines[0] and "TimeoutError" in lines[0]
        assert "20 rate-limit reservations" in lines[1], lines
        fresh = RedisLimitStore(server.url, prefix=prefix)
        assert (await fresh.counts("k")).day_tokens == 600
        await fresh.close()
    finally:
        await limiter.close()
        server.stop()


async def test_leases_redis_cannot_renew_are_logged_once_and_once_renewed_again(tmp_path, prefix, caplog):
    """Redis frozen while a request held a concurrency slot: its renewal was tried every tick and each failure logged
    'could not renew concurrency leases in redis://...: TimeoutError', a line a second (a third of a lease apart at
    most) for the whole outage, and nothing said when they were renewed again. Now once each."""
    server = start_redis(tmp_path)
    store = RedisLimitStore(server.url, prefix=prefix, lease_seconds=0.3, timeout_seconds=0.1)
    try:
        held = await store.reserve(HOLD)
        with caplog.at_level("INFO", logger="server.limits.redis"):
            server.process.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)  # renewals due every 0.1 s, each timing out
            finally:
                server.process.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.5)
        lines = [record.getMessage() for record in caplog.records if "leases" in record.getMessage()]
        assert len(lines) == 2, lines
        assert "could not renew" in lines[0] and "TimeoutError" in lines[0] and "renewed again" in lines[1]
        await store.settle(held, 0)
    finally:
        await store.close()
        server.stop()


async def test_a_release_that_overtakes_its_unanswered_reservation_keeps_it_from_being_booked(redis_server, prefix):
    """An unanswered reservation is released on another connection, which a resuming Redis may serve first."""
    store = RedisLimitStore(redis_server.url, prefix=prefix)
    try:
        ahead = Reservation("overtaken", HOLD, time.time(), None, None)
        await store.release(ahead)  # reaches Redis before the reservation it undoes
        store._ids.new = lambda: "overtaken"  # the reservation now arrives, under the same id
        with pytest.raises(LimitStoreUnavailable) as caught:
            await store.reserve(HOLD)
        await store.release(caught.value.unanswered)  # as the Limiter does: nothing left to undo
        counts = await store.counts("held")
        assert (counts.in_flight, counts.day_requests, counts.window) == (0, 0, ())
    finally:
        await store.close()


def test_a_password_in_the_query_never_reaches_messages():
    """redis-py reads `?password=` too, the usual way to give one to a unix:// socket; the start-up log line naming an
    unreachable store showed it."""
    assert redacted("unix:///run/redis.sock?db=1&password=hunter2") == "unix:///run/redis.sock?db=1&password=***"
    assert redacted("redis://db:6379/0?password=hunter2") == "redis://db:6379/0?password=***"
    assert redacted("redis://:a@db/0?password=b") == "redis://:***@db/0?password=***"


async def test_a_host_whose_clock_runs_a_little_ahead_never_makes_a_per_minute_refusal_final(redis_server, prefix):
    """Hosts synchronised by NTP are milliseconds apart, not together. A burst booked by the host ahead, refused by
    the other: its entries read there as leaving 60.02 s from now, so the per-minute refusal said retry-after 61 and,
    being over a minute, `x-should-retry: false`: both SDKs raised it at once instead of waiting out the minute."""
    behind, ahead = FakeClock(NOON), FakeClock(NOON + 0.02)
    host_a = RedisLimitStore(redis_server.url, clock=behind, prefix=prefix)
    host_b = RedisLimitStore(redis_server.url, clock=ahead, prefix=prefix)
    scope = Scope("k1", "key k1", KeyLimits(requests_per_minute=2, tokens_per_minute=100))
    try:
        for _ in range(2):
            await host_b.settle(await host_b.reserve(Demand((scope,), 50)), 50)
        behind.advance(0.005)
        with pytest.raises(RateLimited) as caught:
            await host_a.reserve(Demand((scope,), 50))
        headers = dict(caught.value.trailing_metadata())
        assert "x-should-retry" not in headers
        assert (headers["retry-after"], headers["retry-after-ms"]) == ("60", "60000")
        assert caught.value.retry_after == 60 and "retry after 60.0 seconds" in caught.value.message
        readings = standing(scope, await host_a.counts("k1"))
        assert [r.wait for r in readings] == [60, 60]  # the LimitService's reset_seconds too
        scope_tokens = Scope("k2", "key k2", KeyLimits(tokens_per_minute=100))
        await host_b.settle(await host_b.reserve(Demand((scope_tokens,), 100)), 100)
        with pytest.raises(RateLimited) as caught:
            await host_a.reserve(Demand((scope_tokens,), 10))
        assert caught.value.retry_after == 60 and "x-should-retry" not in dict(caught.value.trailing_metadata())
        with pytest.raises(RateLimited, match="Request too large"):  # still never fits: no retry hint at all
            await host_a.reserve(Demand((scope_tokens,), 101))
    finally:
        await host_a.close()
        await host_b.close()


async def test_a_redis_that_stopped_answering_costs_one_caller_a_second_a_timeout_not_every_caller(tmp_path, prefix):
    """Frozen (SIGSTOP: the kernel still takes connections), Redis made every admission wait out the timeout for the
    whole outage, one after another, fail-open or not. Once a call timed out, one call a second tries Redis again;
    the others are answered at once as by a Redis that cannot answer, and the first to find it answering ends that."""
    server = start_redis(tmp_path)
    store = RedisLimitStore(server.url, prefix=prefix, timeout_seconds=0.3)
    try:
        await store.reserve(BURST)
        server.process.send_signal(signal.SIGSTOP)
        with pytest.raises(LimitStoreUnavailable):
            await store.reserve(BURST)  # waits out the timeout: nobody knew yet
        waits = []
        for _ in range(8):
            started = time.monotonic()
            with pytest.raises(LimitStoreUnavailable):
                await store.reserve(BURST)
            waits.append(time.monotonic() - started)
        assert max(waits) < 0.1, waits  # within a second of the timeout: no call of these tried Redis
        await asyncio.sleep(1.0)
        started = time.monotonic()
        with pytest.raises(LimitStoreUnavailable):
            await store.reserve(BURST)  # a second on: this one tries Redis, and waits out the timeout
        assert time.monotonic() - started >= 0.25
        server.process.send_signal(signal.SIGCONT)
        await store.settle(await _admitted_again(store), 0)
        started = time.monotonic()
        await store.settle(await store.reserve(BURST), 0)
        assert time.monotonic() - started < 0.25  # served as before
    finally:
        await store.close()
        server.stop()


async def _admitted_again(store: RedisLimitStore) -> Reservation:
    """Admitted once the store tries Redis again, within about a second (_TRIAL_SECONDS) of its last timeout."""
    deadline = time.monotonic() + 2.5
    while True:
        try:
            return await store.reserve(BURST)
        except LimitStoreUnavailable:
            assert time.monotonic() < deadline, "Redis was not tried again"
            await asyncio.sleep(0.05)
