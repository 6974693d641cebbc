"""`portico serve` whose stdout cannot be written (`portico serve > portico.out` on a full disk): its status lines
are for the operator, not a condition of serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway.envoy import free_ports


def _wait_ready(port: int, process: subprocess.Popen, stderr: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited {process.returncode}:\n{stderr.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("not ready within 90 s")


def test_a_gateway_whose_stdout_is_a_full_disk_serves_and_says_which_key_it_made(tmp_path):
    """Its first start printed the development key's secret with a traceback (OSError: No space left on device) and
    stopped, the key made and its secret lost; every later start stopped the same way at `Portico is listening`.
    Now the gateway serves; what it could not print goes to the diagnostic log, the key by its id alone, with what
    to do, and it stops cleanly (exit 0)."""
    port, admin_port, metrics_port = free_ports(3)
    data, stderr = tmp_path / "data", tmp_path / "stderr.log"
    command = [sys.executable, "-m", "server.cli", "--data-dir", str(data), "serve", "--port", str(port),
               "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)]
    for start in range(2):  # the first makes the development key, the second finds keys
        with open("/dev/full", "w") as full, open(stderr, "w") as err:
            process = subprocess.Popen(command, stdout=full, stderr=err)
        try:
            _wait_ready(port, process, stderr)
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        said = stderr.read_text()
        assert "Traceback" not in said and "Exception ignored" not in said
        assert "cannot write to stdout (No space left on device): Portico is listening on" in said
        if start == 0:
            key_id = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data), "keys", "list"],
                                    capture_output=True, text=True, check=True).stdout.split("\t")[0]
            assert (f"cannot write to stdout (No space left on device): created development key {key_id}, but its "
                    f"secret could not be shown: revoke it (portico keys revoke {key_id}) and create a key with "
                    "portico keys create") in said
            assert "pk-" not in said


def test_a_gateway_started_with_stdout_closed_serves(tmp_path):
    """`portico serve >&-` (a process manager that closes what it does not collect): the first socket or file opened
    took descriptor 1, and the gateway aborted (uvloop: Assertion `fd > STDERR_FILENO' failed, exit 134), Envoy too.
    A closed 0, 1 or 2 is now opened on /dev/null first; the status lines it cannot print are logged."""
    port, admin_port, metrics_port = free_ports(3)
    data, stderr = tmp_path / "data", tmp_path / "stderr.log"
    command = [sys.executable, "-m", "server.cli", "--data-dir", str(data), "serve", "--port", str(port),
               "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)]
    with open(stderr, "w") as err:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=err, preexec_fn=lambda: os.close(1))
    try:
        _wait_ready(port, process, stderr)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    said = stderr.read_text()
    assert "Traceback" not in said
    assert "cannot write to stdout (stdout is closed): Portico is listening on" in said
    assert "pk-" not in said
