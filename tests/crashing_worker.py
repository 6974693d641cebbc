"""A stand-in for a `portico worker` that starts, answers one health check (so its supervisor sees it up), then
crashes with exit code 3, or by the signal named after its socket (e.g. SIGBUS)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2_grpc


class _OnceHealthy(health.aio.HealthServicer):
    def __init__(self, checked: asyncio.Event) -> None:
        super().__init__()
        self._checked = checked

    async def Check(self, request, context):
        self._checked.set()
        return await super().Check(request, context)


async def main(socket_path: str, crash: str) -> None:
    checked = asyncio.Event()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(_OnceHealthy(checked), server)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    await checked.wait()
    await asyncio.sleep(0.1)  # the answer reaches the supervisor
    if crash:
        os.kill(os.getpid(), signal.Signals[crash])
    sys.exit(3)


if __name__ == "__main__":
    # A restart is started with --restarted (server/supervisor.py), as `portico worker` is: not a signal's name.
    arguments = [argument for argument in sys.argv[1:] if argument != "--restarted"]
    asyncio.run(main(arguments[0], arguments[1] if len(arguments) > 1 else ""))
