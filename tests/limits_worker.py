"""A separate process using the Redis limit store, for tests of what several processes share.

    python -m tests.limits_worker burst URL PREFIX START_AT ATTEMPTS   prints how many were admitted
    python -m tests.limits_worker crash URL PREFIX HOLD                 takes a slot (lease 1 s), holds it for HOLD
                                                                        seconds, then dies without settling
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from server.domain_keys import KeyLimits
from server.errors import RateLimited
from server.limits import Demand, Scope
from server.limits.redis import RedisLimitStore

BURST = Demand((Scope("burst", "key burst", KeyLimits(requests_per_minute=50)),), 0)
HOLD = Demand((Scope("held", "key held", KeyLimits(concurrent_requests=1)),), 0)


async def burst(url: str, prefix: str, start_at: float, attempts: int) -> int:
    store = RedisLimitStore(url, prefix=prefix, timeout_seconds=5)
    await store.ping()  # connect before the start line
    await asyncio.sleep(max(0.0, start_at - time.time()))
    results = await asyncio.gather(*(store.reserve(BURST) for _ in range(attempts)), return_exceptions=True)
    await store.close()
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, RateLimited):
            raise result
    return sum(not isinstance(r, Exception) for r in results)


async def crash(url: str, prefix: str, hold: float) -> None:
    store = RedisLimitStore(url, prefix=prefix, lease_seconds=1.0)
    await store.reserve(HOLD)
    print("held", flush=True)
    await asyncio.sleep(hold)  # the store renews its lease meanwhile, as for a long request
    os._exit(0)  # no settle, no close: as if the process had been killed


if __name__ == "__main__":
    mode, url, prefix, *rest = sys.argv[1:]
    if mode == "burst":
        print(asyncio.run(burst(url, prefix, float(rest[0]), int(rest[1]))))
    else:
        asyncio.run(crash(url, prefix, float(rest[0])))
