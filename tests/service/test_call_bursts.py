"""A burst of calls that arrives while the server's event loop is busy is served, not cancelled.

grpc-core queues calls the application has not picked up yet and, by default, cancels them at random above 1,000
and all of them above 3,000: 5,000 streams opened within 2 s lost ~1,600 that way (bench, issue 15).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

BURST = 5_000
CONNECTIONS = 20


async def test_calls_queued_while_the_loop_is_busy_are_all_served(running, secret):
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.call_burst_client", str(running.port), secret, str(BURST), str(CONNECTIONS),
        stdout=asyncio.subprocess.PIPE)
    try:
        assert await asyncio.wait_for(client.stdout.readline(), 60) == b"sent\n"
        time.sleep(2.0)  # blocks the server's loop (this test shares it) while the calls arrive and queue in grpc-core
        codes = json.loads(await asyncio.wait_for(client.stdout.readline(), 120))
    finally:
        if client.returncode is None:
            client.kill()
        await client.wait()
    assert codes == {"OK": BURST}
