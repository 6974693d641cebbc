"""Worker supervision: a worker that keeps crashing is restarted a bounded number of times, then the supervisor
gives up (and `portico serve` with it) instead of restarting it forever; every exit is reported."""

from __future__ import annotations

import sys

import pytest

from server import supervisor
from server.supervisor import WorkerError, Workers


async def test_a_crash_loop_ends_supervision_loudly(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "RESTART_DELAY_SECONDS", 0.0)
    exits: list[int] = []
    pool = Workers(1, tmp_path, lambda socket: [sys.executable, "-m", "tests.crashing_worker", str(socket)],
                   on_exit=exits.append)
    await pool.start()
    try:
        with pytest.raises(WorkerError, match=r"worker 0 exited with 3, its 6th exit within 60s"):
            await pool.supervise()
    finally:
        await pool.stop()
    assert len(exits) == supervisor.MAX_RESTARTS + 1 and len(set(exits)) == len(exits)  # one pid per start


async def test_a_worker_killed_by_sigbus_is_named_with_its_likely_cause(tmp_path, monkeypatch):
    """With --workers N a full TMPDIR killed workers by SIGBUS (their metrics are memory-mapped files there), and the
    log said only "worker 1 exited with -7"."""
    monkeypatch.setattr(supervisor, "RESTART_DELAY_SECONDS", 0.0)
    pool = Workers(1, tmp_path, lambda socket: [sys.executable, "-m", "tests.crashing_worker", str(socket), "SIGBUS"])
    await pool.start()
    try:
        with pytest.raises(WorkerError, match=r"worker 0 exited, killed by SIGBUS \(.*TMPDIR.*full.*\), its 6th exit"):
            await pool.supervise()
    finally:
        await pool.stop()
