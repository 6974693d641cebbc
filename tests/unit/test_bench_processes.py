"""The benchmark stops what it starts (docs/performance.md): also a gateway it had paused (SIGSTOP) for the peers'
interleaved rounds, which is what every gateway but the loaded one is when a run is interrupted or fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.common import Processes, tree

# A parent that stops on SIGTERM and a child of its own, as a gateway and its Envoy or workers.
SERVER = ("import signal, subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "signal.signal(signal.SIGTERM, lambda *_: (child.terminate(), sys.exit(0)))\n"
          "print('up', flush=True)\n"
          "time.sleep(60)\n")


def test_a_paused_gateway_is_stopped_at_once(capsys):
    procs = Processes()
    proc = procs.start("paused gateway", [sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    pids = tree(proc.pid)
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    procs.stop_all()
    assert time.monotonic() - started < 5  # not the 20 s grace and a SIGKILL
    assert proc.returncode == 0  # it ran its own SIGTERM handler
    assert "did not stop" not in capsys.readouterr().err
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie waiting for its reaper has stopped."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failed_install_points_at_its_log_not_an_empty_run_directory(tmp_path, monkeypatch, capsys):
    from bench import litellm, run

    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def fail() -> None:
        raise RuntimeError("installing LiteLLM failed (pip install ...): no matching distribution")

    monkeypatch.setattr(run.tempfile, "mkdtemp", lambda prefix: str(run_dir))
    monkeypatch.setattr(litellm, "ensure_venv", fail)
    assert run.main(["--litellm", "only"]) == 1
    err = capsys.readouterr().err
    assert "installing LiteLLM failed" in err
    assert "logs in" not in err and "kept" not in err  # nothing ran: nothing to read there
    assert not run_dir.exists()


def test_bench_handler_interrupted_says_so_in_a_line(monkeypatch, capsys):
    from bench import handler

    started = []
    real_start = Processes.start

    def start(self, name, args, **kwargs):
        started.append(proc := real_start(self, name, args, **kwargs))
        return proc

    def interrupted(coroutine):
        coroutine.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(Processes, "start", start)
    monkeypatch.setattr(handler.uvloop, "run", interrupted)
    assert handler.main(["--requests", "100"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted" in err
    assert started and all(proc.poll() is not None for proc in started)  # the mock upstream stopped


# A gateway that takes a moment to stop, as portico serve draining or LiteLLM's workers.
SLOW_TO_STOP = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(0)))\n"
                "print('up', flush=True)\n"
                "time.sleep(60)\n")


def test_a_second_ctrl_c_does_not_leave_gateways_running(monkeypatch, capsys):
    import threading

    from bench import run

    started = []

    def bench(args, only, wrk, run_dir, procs, litellm_bin):
        proc = procs.start("slow gateway", [sys.executable, "-c", SLOW_TO_STOP], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"up\n"
        started.append(proc)
        # the second Ctrl-C lands while the bench is stopping what it started
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "ensure_wrk", lambda: "wrk")
    monkeypatch.setattr(run, "_bench", bench)
    # Python's own handler, or SIG_IGN when the suite was started in the background (a shell ignores SIGINT there).
    callers = signal.getsignal(signal.SIGINT)
    try:
        assert run.main(["--only", "direct"]) == 130
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                raise AssertionError("the gateway was left running")
    assert started[0].returncode == 0
    assert signal.getsignal(signal.SIGINT) is callers  # the caller's handlers are back
