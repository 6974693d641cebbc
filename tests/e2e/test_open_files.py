"""A gateway started under a low soft limit of open files (a login shell's or a unit's default of 1,024) still holds
as many connections as its hard limit allows: each upstream exchange needs a descriptor of its own."""

from __future__ import annotations

import resource
import threading

import httpx

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue, UpstreamDouble
from tests.upstream_support import UPSTREAM_KEY_ENV

SOFT = 96  # below what the server process needs for 100 upstream exchanges at once (its start-up already holds ~50)
AT_ONCE = 100  # an upstream's pool holds up to 100 connections (max_connections)


def test_many_upstream_exchanges_at_once_under_a_low_soft_limit(tmp_path):
    double = UpstreamDouble().start()
    double.default_cue = Cue(delay=2.0)  # every answer takes two seconds, so all of them are open together
    models = (f"  - {{id: up, endpoint: /v1/chat/completions, provider: {{kind: openai, base_url: '{double.url}', "
              f"api_key_env: {UPSTREAM_KEY_ENV}, model: m}}}}\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))  # inherited by `portico serve`, as from a shell
    lowered = True
    try:
        with upstream_gateway(tmp_path, models) as gateway:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # this test's own clients need many more
            lowered = False
            statuses: list[int] = []

            def ask() -> None:
                answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=30,
                                    headers={"Authorization": f"Bearer {gateway.secret}"},
                                    json={"model": "up", "messages": [{"role": "user", "content": "Hi"}]})
                statuses.append(answer.status_code)

            callers = [threading.Thread(target=ask) for _ in range(AT_ONCE)]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(timeout=60)
            assert statuses == [200] * AT_ONCE, sorted(statuses)
    finally:
        if lowered:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        double.stop()
