"""Rate limits and quotas: requests and tokens per minute (rolling), concurrent requests, tokens and requests per
UTC day, and spend budgets per UTC day and month, per key and optionally per key on one model.

    settings.LimitSettings the `limits:` section
    admission.Limiter      which limits apply, x-ratelimit-* headers      (used by the pipeline)
    core.LimitStore        reserve -> settle | release, all or nothing    (the narrow store interface; `verdict`)
    memory.MemoryLimitStore   exact counters in one process              (the default; day and month on disk:
                              daily_file)
    redis.RedisLimitStore     shared by every process using one Redis    (limits.store: redis://...; its scripts
                              in redis_scripts, its connection in redis_pipe)
    standing               what a key's limits stand at, for LimitService and the console
"""

from server.limits.admission import Limiter, rate_limit_headers
from server.limits.core import Demand, LimitStore, Reservation, Scope
from server.limits.memory import MemoryLimitStore
from server.limits.settings import LimitSettings

__all__ = [
    "Demand", "LimitSettings", "LimitStore", "Limiter", "MemoryLimitStore", "Reservation", "Scope",
    "rate_limit_headers",
]
