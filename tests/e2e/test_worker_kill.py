"""`kill -9` of one of two workers under load costs only the requests in flight on it: Envoy sends the rest, and
every new request, to the other worker (retries within a budget, not a 3-retry circuit breaker; outlier detection
takes the dead worker out of the rotation until it is back)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from tests.e2e.test_workers import wait_for_log, worker_pids, workers  # noqa: F401 - the fixture

CLIENTS = 16
MODELS = "/v1/models"  # answered by a worker, cheap: the load is many short requests


def test_killing_a_worker_under_load_fails_at_most_its_requests_in_flight(workers):  # noqa: F811
    secret = workers.cli("keys", "create", "--name", "kill", "--all-models", "--rpm", "1000000",
                         "--concurrency", "1000").stdout.split()[-1]
    (victim,) = worker_pids(workers, 0)[-1:]
    outcomes: list[tuple[float, int]] = []  # (when it ended, status); 0 for no answer at all

    async def client(http: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            try:
                status = (await http.get(MODELS)).status_code
            except httpx.HTTPError:
                status = 0
            outcomes.append((time.monotonic(), status))

    async def scenario() -> float:
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=workers.base_url, headers=headers, timeout=30,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as http:
            stop_at = time.monotonic() + 5.0
            tasks = [asyncio.create_task(client(http, stop_at)) for _ in range(CLIENTS)]
            await asyncio.sleep(1.0)
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            await asyncio.gather(*tasks)
            return killed_at

    killed_at = asyncio.run(scenario())
    wait_for_log(workers, "worker 0 (pid %d) exited" % victim)
    failed = [status for _, status in outcomes if status != 200]
    before = sum(1 for when, _ in outcomes if when < killed_at)
    after = len(outcomes) - before
    print(f"worker kill: {len(failed)} of {len(outcomes)} failed ({before} before the kill)")
    assert before > 20 and after > 20, (before, after)  # there was load on both sides of the kill
    # At most the requests in flight at the kill: one per client.
    assert len(failed) <= CLIENTS, f"{len(failed)} of {len(outcomes)} failed: {sorted(set(failed))}"
    # And nothing later: while the worker restarts (~2 s), Envoy retries what it sends the dead one on the live one.
    # (A retry that went back to the dead worker failed a few requests ~1.5 s after the kill.)
    late = [round(when - killed_at, 2) for when, status in outcomes if status != 200 and when - killed_at > 0.5]
    assert not late, f"requests failed this long (s) after the kill: {late}"
