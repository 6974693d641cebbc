"""The file system under the gateway fails as an operator's disk does: the data dir (or TMPDIR) on a small tmpfs of
its own that fills up, runs out of inodes or is read-only, at start and while serving, and then has room again.
Needs root (mount); skipped otherwise."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.envoy import free_ports
from server.db.database import StoreUnavailable
from server.usage.sqlite_ledger import SqliteLedger
from tests.e2e.conftest import running_gateway
from tests.unit.test_ledger_writer import row


@contextlib.contextmanager
def tmpfs(directory: Path, options: str = "size=4m") -> Iterator[Path]:
    """A tmpfs mounted at `directory` (made here) until the block ends; the test is skipped where mount is refused."""
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode=0700,{options}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (root needed): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    """A file that takes every byte left on `directory`'s file system."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 512)
    finally:
        os.close(fd)
    return filler


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True)


def portico(data_dir: Path, *args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def serve(data_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    port, admin_port = free_ports(2)
    return portico(data_dir, "serve", "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", "0",
                   env=env)


def chat_rows(data: Path) -> int:
    with contextlib.closing(sqlite3.connect(data / "keys.db", timeout=5)) as db:
        sql = "SELECT count(*) FROM usage_ledger WHERE model = 'family-a-5.5' AND status = 200"
        return db.execute(sql).fetchone()[0]


def test_a_full_data_dir_at_start_is_one_line_that_says_the_disk_is_full(tmp_path):
    """A full disk said 'the key store ... cannot be reached: SQLite: disk I/O error': no word of the disk."""
    with tmpfs(tmp_path / "data") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        fill(data)
        started = serve(data)
        assert started.returncode == 1, started.stderr
        assert started.stderr.count("\n") == 1 and "Traceback" not in started.stderr, started.stderr
        assert f"{data}/keys.db" in started.stderr and "no space left" in started.stderr.lower(), started.stderr


def test_a_signing_key_that_cannot_be_made_at_start_is_one_line(tmp_path):
    """A nearly full data dir (room for the key store's files, not one more block), `image-link.key` deleted to
    invalidate every link as operations.md says: serve stopped with a traceback (OSError: No space left on device)."""
    with tmpfs(tmp_path / "data") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        assert portico(data, "usage").returncode == 0  # the ledger's tables made too
        # Held open, the store keeps its -wal and -shm files, which serve would otherwise need room to make.
        with contextlib.closing(sqlite3.connect(data / "keys.db")) as held:
            held.execute("SELECT count(*) FROM api_keys").fetchall()
            fill(data)
            started = serve(data)
        assert started.returncode == 2, started.stderr
        assert started.stderr == (f"portico: configuration error: data_dir: cannot create {data}/image-link.key "
                                  "(No space left on device)\n")
        assert not [name for name in os.listdir(data) if "image-link" in name]  # no empty key, no temporary file


def test_a_data_dir_out_of_inodes_at_start_is_one_line(tmp_path):
    """Every file and directory of the data dir there already, but no inode left for the ledger spool's first file:
    serve stopped with a traceback (OSError: No space left on device: '.../ledger-spool/<pid>-<ns>.new')."""
    with tmpfs(tmp_path / "data", "size=20m,nr_inodes=64") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        assert portico(data, "usage").returncode == 0
        for directory in ("images", "ledger-spool"):
            (data / directory).mkdir(mode=0o700)
        (data / "image-link.key").write_bytes(os.urandom(32))
        with contextlib.closing(sqlite3.connect(data / "keys.db")) as held:  # keeps its -wal and -shm files
            held.execute("SELECT count(*) FROM api_keys").fetchall()
            with contextlib.suppress(OSError):
                for number in range(100):
                    (data / f"empty-{number}").touch()
            started = serve(data)
        assert started.returncode == 2, started.stderr
        assert started.stderr == (f"portico: configuration error: data_dir: cannot create a file in {data}/ledger-spool"
                                  " (No space left on device)\n")


def test_a_read_only_data_dir_is_said_so_by_serve_and_by_the_commands_that_write(tmp_path):
    """A data dir remounted read-only (a file system the kernel made read-only after an error, a read-only volume)
    said 'SQLite: unable to open database file' to every command: nothing about why."""
    with tmpfs(tmp_path / "data") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        remount(data, "ro")
        for command in (("serve",), ("keys", "create", "--name", "b", "--all-models"), ("keys", "revoke", "key_x")):
            done = serve(data) if command == ("serve",) else portico(data, *command)
            assert done.returncode == 1, (command, done.stderr)
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
            assert f"{data}/keys.db" in done.stderr and "read-only file system" in done.stderr, done.stderr


@pytest.mark.parametrize("left", ["stopped", "killed"])
def test_the_commands_that_only_read_work_on_a_read_only_data_dir(tmp_path, left):
    """`keys list`, `keys get` and `usage` only read, yet failed on a read-only data dir (a read-only volume or
    snapshot, a file system the kernel made read-only): SQLite in WAL mode makes its -wal and -shm files beside
    keys.db to read it. They now read it read-only: a gateway stopped left no -wal (keys.db is whole), a killed one
    left its -wal and -shm, whose rows are read too."""
    with tmpfs(tmp_path / "data") as data:
        made = portico(data, "keys", "create", "--name", "reader", "--env", "prod", "--all-models")
        key_id = made.stdout.split()[2]
        assert portico(data, "usage").returncode == 0  # the ledger's tables made too
        if left == "killed":  # a process that dies holding the store leaves its -wal and -shm
            later = ("import os, sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
                     "db.execute(\"UPDATE api_keys SET name = 'renamed'\"); os._exit(0)")
            subprocess.run([sys.executable, "-c", later, str(data / "keys.db")], check=True)
            assert (data / "keys.db-wal").stat().st_size > 0 and (data / "keys.db-shm").exists()
        before = sorted(os.listdir(data))
        remount(data, "ro")
        name = "renamed" if left == "killed" else "reader"
        listed = portico(data, "keys", "list")
        assert listed.returncode == 0 and listed.stdout.startswith(f"{key_id}\t{name}\tactive\tprod"), listed.stderr
        got = portico(data, "keys", "get", key_id)
        assert got.returncode == 0 and got.stdout.splitlines()[1] == "limits: configured defaults", got.stderr
        usage = portico(data, "usage")
        assert usage.returncode == 0 and usage.stderr == "", usage.stderr
        remount(data, "rw")
        assert sorted(os.listdir(data)) == before


def test_a_full_tmpdir_is_said_to_be_full_not_closed_to_the_user(tmp_path):
    """TMPDIR on a full tmpfs of its own (the run directory's sockets and Envoy's config go there) was refused as
    'not a directory this user may write in (permission denied)', sending the operator to chmod."""
    with tmpfs(tmp_path / "run", "size=1m") as run:
        fill(run)
        started = serve(tmp_path / "data", env={"TMPDIR": str(run)})
    assert started.returncode == 2, started.stderr
    assert started.stderr.count("\n") == 1, started.stderr
    assert f"TMPDIR: {run}" in started.stderr and "(no space left on device)" in started.stderr, started.stderr
    assert "permission denied" not in started.stderr


def test_a_tmpdir_with_too_little_room_for_envoys_configuration_is_one_line(tmp_path):
    """TMPDIR with a few KiB left (a small /run nearly full) passes Python's check, which writes 4 bytes there; the
    run directory is made and the server started, then Envoy's configuration (~100 KiB) did not fit: a traceback
    (OSError: No space left on device) from gateway/envoy.py."""
    with tmpfs(tmp_path / "run", "size=1m") as run:
        (run / "spare").write_bytes(b"x" * 8192)
        fill(run)
        (run / "spare").unlink()
        started = serve(tmp_path / "data", env={"TMPDIR": str(run)})
        assert os.listdir(run) == ["filler"]  # the run directory removed
    assert started.returncode == 1, started.stderr
    assert "Traceback" not in started.stderr, started.stderr
    assert re.search(rf"ERROR portico: Envoy did not start: cannot write its configuration {run}/portico-\w+/"
                     r"envoy\.yaml \(No space left on device\)\n", started.stderr), started.stderr


def test_a_data_dir_that_fills_while_serving_loses_no_ledger_row_and_recovers_by_itself(tmp_path):
    """The data dir fills up under a serving gateway, then has room again: text is still answered (its rows wait
    in memory), a link image, a key write and `portico keys` are refused in their documented words, /readyz stays
    ready (the store still answers reads), and once there is room every row is written and keys are made again,
    without a restart."""
    with tmpfs(tmp_path / "data", "size=6m") as data:
        admin = portico(data, "keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
        with running_gateway(data, dev_key=False) as gateway:
            client = httpx.Client(base_url=gateway.base_url, timeout=60,
                                  headers={"authorization": f"Bearer {admin}"})
            chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
            other = client.post("/v1/admin/keys", json={"name": "a", "all_models": True}).json()["key"]["id"]
            filler = fill(data)
            for _ in range(3):
                assert client.post("/v1/chat/completions", json=chat).status_code == 200
            for _ in range(3):  # an image client retrying: one log line, not one a request
                image = client.post("/v1/images/generations", json={"model": "family-a-image-2", "prompt": "a cat",
                                                                       "size": "256x256", "response_format": "url"})
                assert image.status_code == 503 and image.headers["retry-after"] == "5", image.text
                # Drawn and counted before it could not be stored: an SDK's own retries would draw and bill again.
                assert image.headers["x-should-retry"] == "false", image.headers
            for path, body in (("/v1/admin/keys", {"name": "later", "all_models": True}),
                               (f"/v1/admin/keys/{other}/rotate", {}), (f"/v1/admin/keys/{other}", {"name": "b"})):
                written = client.request("PATCH" if body == {"name": "b"} else "POST", path, json=body)
                assert written.status_code == 503 and written.headers.get("retry-after"), written.text
                assert written.json()["error"]["code"] == "service_unavailable"
            cli = portico(data, "keys", "create", "--name", "later", "--all-models")
            assert cli.returncode == 1 and cli.stderr.count("\n") == 1 and "Traceback" not in cli.stderr, cli.stderr
            assert client.get("/readyz").status_code == 200
            filler.unlink()
            deadline = time.monotonic() + 45  # the ledger's retry pause grows to 30 s
            while (rows := chat_rows(data)) < 4:
                assert time.monotonic() < deadline, rows
                time.sleep(1)
            assert rows == 4
            assert client.post("/v1/admin/keys", json={"name": "later", "all_models": True}).status_code == 200
            assert client.post("/v1/images/generations", json={
                "model": "family-a-image-2", "prompt": "a cat", "size": "256x256",
                "response_format": "url"}).status_code == 200
        log = gateway.log_path.read_text()
        assert "Traceback" not in log
        # The key write's own failure, not that of the ROLLBACK after it (SQLite had rolled back by itself).
        assert "the key store failed (SQLite: database or disk is full" in log and "cannot rollback" not in log, log
        assert log.count("cannot store generated images") == 1, log[-3000:]

        assert log.count(f"generated images are stored in {data}/images again") == 1, log[-3000:]


def test_a_data_dir_out_of_inodes_is_one_log_line_not_two_a_second(tmp_path):
    """Out of inodes (bytes to spare), the spool's rows go on into its current file, but each write pass that tried
    to start a new one logged 'cannot write the spool ... rows wait in memory only' and the next row's append
    'writing the spool again': two error lines a second for as long as it lasted, each saying rows were at risk."""
    with tmpfs(tmp_path / "data", "size=20m,nr_inodes=100") as data:
        admin = portico(data, "keys", "create", "--name", "a", "--all-models").stdout.split()[-1]
        with running_gateway(data, dev_key=False) as gateway:
            client = httpx.Client(base_url=gateway.base_url, timeout=60, headers={"authorization": f"Bearer {admin}"})
            chat = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            made = 0
            with contextlib.suppress(OSError):
                while True:
                    (data / f"empty-{made}").touch()
                    made += 1
            for _ in range(6):
                assert client.post("/v1/chat/completions", json=chat).status_code == 200
                time.sleep(1.2)  # a write pass between requests
            for number in range(made):
                (data / f"empty-{number}").unlink()
            deadline = time.monotonic() + 30
            while (rows := chat_rows(data)) < 6:
                assert time.monotonic() < deadline, rows
                time.sleep(0.5)
        log = gateway.log_path.read_text()
    assert "cannot write the spool" not in log and "writing the spool again" not in log, log[-3000:]
    assert log.count("cannot start a new spool file") == 1, log[-3000:]
    assert "rows wait in memory only" not in log


def test_a_ledger_write_on_a_full_disk_says_the_disk_is_full(tmp_path):
    """The writer's one line for a batch SQLite cannot store, 'usage ledger: cannot write rows (OperationalError:
    database or disk is full)', named neither the data dir nor its file system."""
    with tmpfs(tmp_path / "data") as data:
        ledger = SqliteLedger(data / "keys.db")
        try:
            fill(data)
            rows = [row(n) for n in range(5000)]  # more than the WAL already has room for
            with pytest.raises(StoreUnavailable) as failed:
                ledger.write(rows)
            assert str(failed.value) == f"SQLite: database or disk is full ({data}: no space left on device)"
        finally:
            ledger.close()


def test_the_deployments_health_board_has_its_room_before_its_file_system_fills(tmp_path):
    """With --workers N, the deployments' passive health is a file in the run directory (TMPDIR) every worker maps.
    It was sized sparse (ftruncate): a TMPDIR that filled afterwards killed the first worker to mark a deployment's
    failure on a page never written before with SIGBUS. Its blocks are now taken when it is made."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from server.domain_models import HealthSettings\n"
        "from server.providers.health import FileBoard\n"
        "board = FileBoard(Path(sys.argv[1]) / 'health', [('m', f'd{n}', HealthSettings()) for n in range(2000)])\n"
        "sys.stdout.write('made\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        "board.failed(1999)\n"
        "print(board.states()[1999][2])\n"
    )
    with tmpfs(tmp_path / "run", "size=2m") as run:
        worker = subprocess.Popen([sys.executable, "-c", script, str(run)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline() == "made\n"
        fill(run)
        out, _ = worker.communicate("\n", timeout=30)
        assert worker.returncode == 0, f"the worker died: {worker.returncode}"
        assert out == "healthy\n"  # one failure does not eject it; the failure is on the board
