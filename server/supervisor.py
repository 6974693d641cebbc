"""`portico serve --workers N`: N gRPC server processes, each on its own unix socket, so that Envoy (one endpoint per
process) spreads load over them; one HTTP/2 connection to a single process would keep only that process busy.

The parent starts every worker as `python -m server.cli ... worker --socket PATH`, waits until its gRPC health
service answers (SERVING, or NOT_SERVING while a store is down: up but not ready), and watches it: a worker that
dies is logged and restarted on the same socket, so Envoy's endpoint stays valid (Envoy retries connect failures on
another endpoint meanwhile); one whose health service stays silent for `worker_hang_seconds` is killed first. A
worker that cannot start again, or that exits a (MAX_RESTARTS + 1)th time within RESTART_WINDOW_SECONDS, takes the
whole gateway down, loudly: never half-up. Workers get PR_SET_PDEATHSIG, like Envoy, so none outlives the parent.
Limits are only exact across workers with a shared store (Redis): the CLI refuses N > 1 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.processes import start_supervised, terminate

_logger = logging.getLogger(__name__)

RESTART_DELAY_SECONDS = 1.0
HANG_CHECK_SECONDS = 5.0  # how often the watchdog asks each worker's health service (worker_hang_seconds)
MAX_RESTARTS = 5  # within RESTART_WINDOW_SECONDS, for one worker: more is a crash loop, not bad luck
RESTART_WINDOW_SECONDS = 60.0


class WorkerError(RuntimeError):
    """A worker did not become ready."""


def exit_text(returncode: int) -> str:
    """How a worker (or Envoy) ended, for the operator: a signal by its name, SIGBUS with its usual cause."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"exited, killed by signal {-returncode}"
    if -returncode == signal.SIGBUS:  # a page of a memory-mapped file (the workers' metrics) found no room
        return f"exited, killed by {name} (a memory-mapped file could not grow: is the file system of TMPDIR full?)"
    return f"exited, killed by {name}"


def socket_name(worker: int | None) -> str:
    """A server's socket in the run directory: the one process's, or worker `worker`'s."""
    return "grpc.sock" if worker is None else f"grpc-{worker}.sock"


class WorkerProcess:
    def __init__(
        self,
        index: int,
        socket_path: Path,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 120.0,
    ):
        self.index = index
        self.socket_path = socket_path
        self._command = list(command)
        self._env = {**os.environ, **(env or {})}
        self._ready_timeout_s = ready_timeout_s
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self, *, restarted: bool = False) -> None:
        """Start the process and return once it serves; WorkerError if it exits or stays silent. `restarted`: after
        a crash, told so (it then uses the database as its siblings do, migrated since by a newer host or not)."""
        self.socket_path.unlink(missing_ok=True)  # a dead predecessor's socket
        self._proc = await start_supervised(
            *self._command, *(["--restarted"] if restarted else []), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, env=self._env,
        )  # stderr is inherited: worker logs go where the parent's go
        deadline = asyncio.get_running_loop().time() + self._ready_timeout_s
        while not await self._answers():
            if self._proc.returncode is not None:
                raise WorkerError(f"worker {self.index} {exit_text(self._proc.returncode)} before it was ready")
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise WorkerError(f"worker {self.index} not ready after {self._ready_timeout_s:g}s")
            await asyncio.sleep(0.1)
        _logger.info("worker %d (pid %d) serving on unix:%s", self.index, self.pid, self.socket_path)

    async def _answers(self, timeout_s: float = 1.0) -> bool:
        if not self.socket_path.exists():
            return False
        async with grpc.aio.insecure_channel(f"unix:{self.socket_path}") as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                return False
        return True

    async def watch(self, hang_s: float) -> None:
        """Kill the worker once its health service has not answered for `hang_s` (stopped, or its event loop stuck):
        Envoy's own checks send it no new requests, but those it holds would wait for Envoy's 300 s silence limit.
        Killed, they end at once (a 503 to their callers, which the SDKs retry), the next process writes its ledger
        rows (server/usage/spool.py) and `supervise` restarts it. A worker that answers NOT_SERVING answers."""
        process, loop = self._proc, asyncio.get_running_loop()
        assert process is not None
        every = min(HANG_CHECK_SECONDS, max(hang_s / 3, 0.5))  # each check's own timeout: a slow answer is one
        answered = loop.time()
        while process.returncode is None:
            await asyncio.sleep(every)
            if await self._answers(timeout_s=every):
                answered = loop.time()
            elif loop.time() - answered >= hang_s and process.returncode is None:
                _logger.error("worker %d (pid %d) has not answered its health checks for %gs; killing it",
                              self.index, process.pid, loop.time() - answered)
                process.kill()
                return

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    def signal_stop(self) -> None:
        """SIGTERM, if it runs: the first starts its drain, a second one ends the drain at once."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the worker drains its RPCs for up to drain_seconds), then SIGKILL after `grace_s`."""
        if self._proc is not None:
            await terminate(self._proc, grace_s)


class Workers:
    def __init__(
        self,
        count: int,
        run_dir: Path,
        command_for: Callable[[Path], Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 10.0,
        hang_s: float = 0.0,
        on_exit: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self._workers = [
            WorkerProcess(i, path, command_for(path), env=env)
            for i in range(count)
            for path in [run_dir / socket_name(i)]
        ]
        self._stop_grace_s = stop_grace_s
        self._hang_s = hang_s  # a worker silent this long is killed (WorkerProcess.watch); 0: never
        self._on_exit = on_exit  # e.g. forget a dead worker's in-flight gauge

    @property
    def upstreams(self) -> list[str]:
        return [f"unix:{w.socket_path}" for w in self._workers]

    async def start(self) -> None:
        results = await asyncio.gather(*(w.start() for w in self._workers), return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            await self.stop()
            raise errors[0]

    async def supervise(self) -> None:
        """Restart workers that die, for as long as Portico runs; raises WorkerError if a restart fails."""
        watchers = {asyncio.create_task(w.wait()): w for w in self._workers}
        watchdogs = {w.index: self._watchdog(w) for w in self._workers}
        exits: dict[int, deque[float]] = {w.index: deque(maxlen=MAX_RESTARTS) for w in self._workers}
        try:
            while True:
                done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    worker = watchers.pop(task)
                    if dog := watchdogs.pop(worker.index):
                        dog.cancel()
                    if worker.pid is not None:
                        self._on_exit(worker.pid)
                    now = asyncio.get_running_loop().time()
                    recent = exits[worker.index]
                    if len(recent) == MAX_RESTARTS and now - recent[0] < RESTART_WINDOW_SECONDS:
                        raise WorkerError(f"worker {worker.index} {exit_text(task.result())}, its "
                                          f"{MAX_RESTARTS + 1}th exit within {RESTART_WINDOW_SECONDS:g}s")
                    recent.append(now)
                    _logger.error("worker %d (pid %s) %s; restarting it", worker.index, worker.pid,
                                  exit_text(task.result()))
                    await asyncio.sleep(RESTART_DELAY_SECONDS)
                    await worker.start(restarted=True)
                    watchers[asyncio.create_task(worker.wait())] = worker
                    watchdogs[worker.index] = self._watchdog(worker)
        finally:
            for task in [*watchers, *filter(None, watchdogs.values())]:
                task.cancel()

    def _watchdog(self, worker: WorkerProcess) -> asyncio.Task | None:
        return asyncio.create_task(worker.watch(self._hang_s)) if self._hang_s else None

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop(self._stop_grace_s) for w in self._workers))
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.socket_path.unlink(missing_ok=True)

    async def stop_now(self) -> None:
        """During `stop`: each worker ends its drain at once (a second SIGTERM)."""
        for worker in self._workers:
            worker.signal_stop()
