"""Supervised child processes, for the Envoy launcher (gateway/envoy.py) and the worker supervisor
(server/supervisor.py): started so that they can never outlive Portico, and stopped with a grace period.

PR_SET_PDEATHSIG makes the kernel send a child SIGTERM when the thread that started it dies (start children from the
event loop's thread, which lives as long as Portico). Each child runs in its own process group, so that a terminal's
Ctrl-C reaches only Portico, which drains it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from typing import Any

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def supervised_child(libc: ctypes.CDLL, parent_pid: int) -> None:
    """preexec_fn for every process Portico starts (runs in the child between fork and exec).

    Its own process group: signals reach it only through Portico. A terminal's Ctrl-C is sent to the whole
    foreground group, and Envoy (or a worker) would act on it alone: Envoy stops at once, cutting the requests
    that Portico's drain would let finish. And SIGTERM when the parent dies; bail out if it already has.
    """
    os.setpgid(0, 0)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        os._exit(127)
    if os.getppid() != parent_pid:  # the parent died between fork() and prctl()
        os._exit(127)


async def start_supervised(*args: str, **options: Any) -> asyncio.subprocess.Process:
    """asyncio.create_subprocess_exec(*args, **options) for a child that dies with Portico."""
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()  # loaded here: no dlopen after fork
    return await asyncio.create_subprocess_exec(*args, preexec_fn=lambda: supervised_child(libc, parent), **options)


async def terminate(proc: asyncio.subprocess.Process, grace_s: float) -> int:
    """SIGTERM a supervised child (if it still runs), then SIGKILL if it is alive after `grace_s`; its exit code."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
    return proc.returncode
