"""Portico run as an unprivileged service user, as production runs it, and administered by others (root, a second
user). The module makes two throwaway system users (removed at its end), so it needs root (CI runs as root) and
skips without it; every command runs with the checkout as its working directory, so the checkout's code is the one
imported."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import signal
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.envoy import free_ports

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="makes system users: needs root and useradd")

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class User:
    name: str
    home: Path

    def run(self, *args: str, umask: int = 0o022, **env: str) -> subprocess.CompletedProcess:
        """`python -m server.cli ARGS` as this user, from the checkout (so its code is the one imported)."""
        return subprocess.run([sys.executable, "-m", "server.cli", *args], **self._as_me(umask, env),
                              capture_output=True, text=True, timeout=60)

    def start(self, *args: str, umask: int = 0o022, **env: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "server.cli", *args], **self._as_me(umask, env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _as_me(self, umask: int, env: dict[str, str]) -> dict:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", **env}
        return {"cwd": REPO, "env": env, "user": self.name, "group": self.name, "extra_groups": [], "umask": umask}


@contextlib.contextmanager
def system_user(base: Path) -> Iterator[User]:
    name = f"portico-t{secrets.token_hex(3)}"
    home = base / name
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(home),
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        home.mkdir()
        home.chmod(0o755)  # not mkdir's mode: an in-process `portico` command earlier in the run set umask 077
        shutil.chown(home, name, name)
        yield User(name, home)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    """The service's user and a second, unrelated one, with homes under a directory both may enter."""
    base = Path(tempfile.mkdtemp(prefix="portico-users-"))
    base.chmod(0o755)
    try:
        with system_user(base) as service, system_user(base) as other:
            if service.run("--help").returncode != 0:
                pytest.skip(f"{service.name} cannot run the checkout's code (is {REPO} readable by all?)")
            yield service, other
    finally:
        shutil.rmtree(base, ignore_errors=True)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    return line


def test_a_store_root_made_stops_the_services_start_with_what_to_do(users):
    """`portico keys create` run as root before the service's first start made the data dir and keys.db root's
    (0700, 0600): the service's user got "the key store ... cannot be reached: SQLite: unable to open database
    file", which says nothing of whose files they are."""
    service, _ = users
    data = service.home / "data"
    subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data), "keys", "create", "--name", "ops",
                    "--all-models"], cwd=REPO, check=True, capture_output=True, timeout=60)
    shutil.chown(data, service.name, service.name)  # the operator gave the directory over, not keys.db
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("--data-dir", str(data), "serve", "--port", str(port), "--admin-port", str(admin_port),
                       "--metrics-port", str(metrics_port))
    assert done.returncode == 2 and "listening" not in done.stdout
    assert one_line(done) == (f"portico: configuration error: data_dir: {data}/keys.db belongs to root, and portico "
                              f"runs as {service.name} here: give the data dir to {service.name} "
                              f"(chown -R {service.name}: {data})")
    subprocess.run(["chown", "-R", f"{service.name}:", str(data)], check=True)
    assert service.run("--data-dir", str(data), "keys", "list").stdout.count("\tops\t") == 1  # and then it works


def test_a_directory_root_made_in_the_data_dir_is_said_before_the_model_loads(users):
    """A `portico serve` once run as root left images/ and ledger-spool/ root's: the service's user got a
    PermissionError traceback from the ledger's spool after the model had loaded."""
    service, _ = users
    data = service.home / "data-spool"
    data.mkdir(mode=0o700)
    shutil.chown(data, service.name, service.name)
    (data / "ledger-spool").mkdir(mode=0o700)  # root's
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("--data-dir", str(data), "serve", "--port", str(port), "--admin-port", str(admin_port),
                       "--metrics-port", str(metrics_port))
    assert done.returncode == 2
    assert f"data_dir: {data}/ledger-spool belongs to root" in one_line(done)


@pytest.mark.parametrize("command", [["keys", "list"], ["keys", "create", "--name", "x", "--all-models"], ["usage"]])
def test_another_user_is_told_whose_store_it_is(users, command):
    """A second user's `portico keys` or `usage` on the service's data dir (0700) was a PermissionError traceback;
    it reads nothing, and is told to run the command as the service's user."""
    service, other = users
    data = service.home / "data-own"
    assert service.run("--data-dir", str(data), "keys", "create", "--name", "mine", "--all-models").returncode == 0
    done = other.run("--data-dir", str(data), *command)
    assert done.returncode == 2 and done.stdout == ""
    assert one_line(done) == (f"portico: configuration error: data_dir: {data} belongs to {service.name}, and "
                              f"portico runs as {other.name} here: run portico as {service.name}, or give the data "
                              f"dir to {other.name} (chown -R {other.name}: {data})")


def test_a_file_of_someone_else_beside_the_store_is_left_alone(users):
    """An operator's own readable file in the data dir (a note, a lost+found) is not Portico's to make private:
    the service's user may not chmod it, which was a PermissionError traceback at every command."""
    service, _ = users
    data = service.home / "data-note"
    assert service.run("--data-dir", str(data), "keys", "create", "--name", "mine", "--all-models").returncode == 0
    note = data / "README.txt"
    note.write_text("the gateway's data\n")
    note.chmod(0o644)  # root's
    done = service.run("--data-dir", str(data), "keys", "list")
    assert done.returncode == 0 and "\tmine\t" in done.stdout, done.stderr
    assert note.stat().st_mode & 0o777 == 0o644


def test_a_temp_dir_the_user_may_not_write_in_is_one_line(users):
    """TMPDIR set to a directory of root's: the run directory (Envoy's config, the sockets) silently went to /tmp."""
    service, _ = users
    temp = service.home.parent / "roots-tmp"
    temp.mkdir(exist_ok=True)
    temp.chmod(0o755)
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("--data-dir", str(service.home / "data-tmp"), "serve", "--port", str(port), "--admin-port",
                       str(admin_port), "--metrics-port", str(metrics_port), TMPDIR=str(temp))
    assert done.returncode == 2
    assert one_line(done) == (f"portico: configuration error: TMPDIR: {temp} is not a directory this user may write "
                              "in (permission denied): make it one, or unset TMPDIR to use /tmp")


@pytest.mark.parametrize("command", [["keys", "list"], ["usage"], ["serve", "--port", "1080"]])
def test_a_data_dir_behind_roots_directory_is_one_line(users, command):
    """data_dir under a directory only root may enter (`~/data` read with root's HOME, /root/...) was a
    PermissionError traceback at every command."""
    service, _ = users
    closed = service.home.parent / "roots-only"
    closed.mkdir(mode=0o700, exist_ok=True)
    done = service.run("--data-dir", str(closed / "data"), *command)
    assert done.returncode == 2
    assert one_line(done) == (f"portico: configuration error: data_dir: cannot reach {closed}/data (Permission "
                              f"denied): portico runs as {service.name} here, which may not enter a directory on "
                              f"that path: choose a data dir {service.name} may reach (--data-dir, data_dir)")


def test_a_model_file_behind_roots_directory_is_one_line(users):
    """embedded.model_path in a directory only root may enter was a PermissionError traceback while the
    configuration was read."""
    service, _ = users
    closed = service.home.parent / "roots-only"
    closed.mkdir(mode=0o700, exist_ok=True)
    config = service.home.parent / "model-config.yaml"
    config.write_text((REPO / "server/default.yaml").read_text().replace(
        "\nembedded:\n", f"\nembedded:\n  model_path: {closed}/model.gguf\n", 1))
    config.chmod(0o644)
    done = service.run("--config", str(config), "--data-dir", str(service.home / "data-model"), "keys", "list")
    assert done.returncode == 2
    assert one_line(done) == (f"portico: configuration error: {config}: embedded.model_path: cannot read "
                              f"{closed}/model.gguf (Permission denied): the user portico runs as may not enter a "
                              "directory on that path")


def test_the_service_users_gateway_keeps_its_files_private_and_leaves_nothing_behind(users):
    """Run as the service's user under the loosest umask: every file in the data dir and the run directory is its
    user's alone, and a stop leaves nothing in TMPDIR nor in /dev/shm, where Envoy's hot-restart shared memory
    (a file per run, never removed) piled up on every start."""
    service, _ = users
    data, temp = service.home / "data-serve", service.home / "tmp"
    temp.mkdir(mode=0o700)
    shutil.chown(temp, service.name, service.name)
    port, admin_port, metrics_port = free_ports(3)
    process = service.start("--data-dir", str(data), "serve", "--port", str(port), "--admin-port", str(admin_port),
                            "--metrics-port", str(metrics_port), umask=0, TMPDIR=str(temp))
    try:
        printed = ""
        while "Portico is listening" not in printed:
            line = process.stdout.readline()
            assert line, process.stderr.read()
            printed += line
        secret = re.search(r"\b(pk-\S+)", printed).group(1)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                            headers={"authorization": f"Bearer {secret}"},
                            json={"model": "family-a-5.5", "max_tokens": 1, "messages": [{"role": "user",
                                                                                          "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        (run_dir,) = temp.iterdir()
        assert {path.name for path in run_dir.iterdir()} >= {"envoy.yaml", "envoy-admin.sock", "grpc.sock"}
        private(service, [run_dir, *run_dir.iterdir()])
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=40)
    assert process.returncode == 0
    assert {path.name for path in data.iterdir()} >= {"keys.db", "limits-daily.json", "envoy.log", "ledger-spool"}
    private(service, [data, *data.rglob("*")])
    assert not list(temp.iterdir())
    assert not owned_by(service, Path("/dev/shm"))


def private(user: User, paths: list[Path]) -> None:
    uid = pwd.getpwnam(user.name).pw_uid
    for path in paths:
        info = path.lstat()
        assert info.st_uid == uid and info.st_mode & 0o077 == 0, (path, oct(info.st_mode))


def owned_by(user: User, directory: Path) -> list[Path]:
    uid, owned = pwd.getpwnam(user.name).pw_uid, []
    for path in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):  # another session's, removed meanwhile
            if path.lstat().st_uid == uid:
                owned.append(path)
    return owned


def test_the_default_data_dir_is_named_whole_when_it_cannot_be_made(users):
    """`make serve` (or `portico serve` without --data-dir) as the service's user in a checkout it may not write:
    "cannot create data (Permission denied)" did not say where "data" was."""
    service, _ = users
    if os.stat(REPO).st_mode & 0o002:
        pytest.skip(f"{REPO} is writable by all")
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("serve", "--port", str(port), "--admin-port", str(admin_port), "--metrics-port",
                       str(metrics_port))
    assert done.returncode == 2
    assert one_line(done) == f"portico: configuration error: data_dir: cannot create {REPO}/data (Permission denied)"


def test_an_access_log_root_made_says_whose_it_is(users):
    """A file access log a first start as root made (0600, root's): the service's user was told only "Permission
    denied" about a file in a directory it owns."""
    service, _ = users
    log = service.home / "access.log"
    log.touch(mode=0o600)  # root's
    config = service.home.parent / "access-log-config.yaml"
    config.write_text((REPO / "server/default.yaml").read_text().replace("\naccess_log: stderr ",
                                                                          f"\naccess_log: {log} ", 1))
    config.chmod(0o644)
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("--config", str(config), "--data-dir", str(service.home / "data-log"), "serve", "--port",
                       str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port))
    assert done.returncode == 2
    assert one_line(done) == (f"portico: configuration error: access_log: cannot open {log} (Permission denied: it "
                              f"belongs to root, and portico runs as {service.name} here: chown {service.name}: "
                              f"{log})")


def test_roots_keys_command_on_the_services_data_dir_leaves_the_files_the_services(users):
    """`sudo portico keys create` (root) on the service's data dir, before the service made its store: keys.db was
    root's (0600), and the service could not open it at its next start."""
    service, _ = users
    data = service.home / "data-sudo"
    data.mkdir(mode=0o700)
    shutil.chown(data, service.name, service.name)
    as_root = [sys.executable, "-m", "server.cli", "--data-dir", str(data)]
    subprocess.run([*as_root, "keys", "create", "--name", "ops", "--all-models"], cwd=REPO, check=True,
                   capture_output=True, timeout=60)
    assert "\tops\t" in subprocess.run([*as_root, "keys", "list"], cwd=REPO, check=True, capture_output=True,
                                       text=True, timeout=60).stdout
    assert "total" in subprocess.run([*as_root, "usage"], cwd=REPO, check=True, capture_output=True, text=True,
                                     timeout=60).stdout
    private(service, [data, *data.iterdir()])
    assert "\tops\t" in service.run("--data-dir", str(data), "keys", "list").stdout


@pytest.mark.parametrize(("closed", "mode", "letters"), [("", 0o500, "rwx"), ("keys.db", 0o400, "rw")])
def test_a_data_dir_or_store_made_read_only_is_one_line(users, closed, mode, letters):
    """A data dir chmod 500 was SQLite's "attempt to write a readonly database" about a keys.db that was writable;
    a keys.db chmod 400 let the gateway start (half up: its usage ledger then failed)."""
    service, _ = users
    data = service.home / f"data-read-only-{mode:o}"
    assert service.run("--data-dir", str(data), "keys", "create", "--name", "mine", "--all-models").returncode == 0
    path = data / closed if closed else data
    path.chmod(mode)
    port, admin_port, metrics_port = free_ports(3)
    done = service.run("--data-dir", str(data), "serve", "--port", str(port), "--admin-port", str(admin_port),
                       "--metrics-port", str(metrics_port))
    assert done.returncode == 2 and "listening" not in done.stdout
    assert one_line(done) == (f"portico: configuration error: data_dir: {path} is mode {mode:04o}: portico must "
                              f"read and write it (chmod u+{letters} {path})")
