"""The `portico` command as an operator runs it from a unit file or a script (no shell to expand `~`, output to a
file on a disk that may be full): what configuration.md's "Command line" promises."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from server.cli import main


def test_a_home_relative_data_dir_and_config_option_are_the_home_directory_as_in_the_file(tmp_path, monkeypatch,
                                                                                        capsys):
    """configuration.md: `~/` in `data_dir` is the home directory. Moved from the file to `--data-dir ~/data` in a
    systemd unit or a container's args (no shell expands it), the option made a directory named `~` under the working
    directory, with a new empty key store in it, and `keys list` there said there was none; `--config ~/p.yaml` was
    'cannot read'. The options now read `~/` as the file does."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (home / "p.yaml").write_text("models:\n  - {id: m, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}\n")
    assert main(["--config", "~/p.yaml", "--data-dir", "~/data", "keys", "create", "--name", "n", "--models", "m"]) == 0
    assert (home / "data" / "keys.db").exists()
    assert not (work / "~").exists()
    capsys.readouterr()
    assert main(["keys", "list", "--config", "~/p.yaml", "--data-dir", "~/data"]) == 0
    assert "\tn\tactive\t-\tm\n" in capsys.readouterr().out


def _portico(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def test_output_to_a_full_disk_is_one_line_and_a_lost_secret_names_its_key(tmp_path):
    """`portico keys create ... > secret.txt` on a full disk printed a traceback (OSError: No space left on
    device) after the key was made, its secret lost and its id unsaid; `keys list`, `usage` the same traceback. Now
    one line, exit 1, and for a secret that could not be written, the key it belongs to and what to do."""
    data = ["--data-dir", str(tmp_path / "d")]
    assert _portico(*data, "keys", "create", "--name", "first", "--all-models").returncode == 0
    with open("/dev/full", "w") as full:
        created = _portico(*data, "keys", "create", "--name", "lost", "--all-models", stdout=full)
        listed = _portico(*data, "keys", "list", stdout=full)
        reported = _portico(*data, "usage", stdout=full)
    lost_id = next(row.split("\t")[0] for row in _portico(*data, "keys", "list").stdout.splitlines()
                   if row.split("\t")[1] == "lost")
    with open("/dev/full", "w") as full:
        rotated = _portico(*data, "keys", "rotate", lost_id, stdout=full)
    assert created.returncode == 1
    assert created.stderr == (f"portico: created key {lost_id} (lost), but its secret could not be written (No space "
                              f"left on device): revoke it (portico keys revoke {lost_id}) and create another\n")
    assert rotated.returncode == 1
    assert rotated.stderr == (f"portico: rotated key {lost_id} (lost), but its new secret could not be written (No "
                              f"space left on device): rotate it again\n")
    for done in (listed, reported):
        assert done.returncode == 1
        assert done.stderr == "portico: cannot write the output (No space left on device)\n"


@pytest.mark.parametrize("command", [["keys", "list"], ["keys", "get", "key_0123456789abcdef"], ["usage"],
                                     ["keys", "create", "--name", "n", "--all-models"]])
def test_a_mistyped_data_dir_is_refused_without_changing_its_permissions(tmp_path, capsys, command):
    """`portico keys list --data-dir /srv` (for /srv/portico), or a data_dir naming a file, run as root: the
    command said there was no key store (or that a file is there) and exited, but had already taken group and
    other access away from what it named: /srv became 0700, a file 0600 (here: /etc/passwd, after which no other
    user could look up a user name). A command now leaves what is not a data dir as it was."""
    shared = tmp_path / "srv"
    shared.mkdir()
    (shared / "site.conf").write_text("another service's")
    named_file = tmp_path / "passwd"
    named_file.write_text("root:x:0:0::/root:/bin/sh\n")
    for path, mode in ((tmp_path, 0o755), (shared, 0o755), (shared / "site.conf", 0o644), (named_file, 0o644)):
        path.chmod(mode)
    creates = command[:2] == ["keys", "create"]
    for data_dir in ((named_file,) if creates else (shared, named_file)):
        assert main(["--data-dir", str(data_dir), *command]) == (2 if creates else 1)
        assert capsys.readouterr().err.count("\n") == 1
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in (shared, shared / "site.conf", named_file)} == {
        "srv": 0o755, "site.conf": 0o644, "passwd": 0o644}
    assert sorted(path.name for path in shared.iterdir()) == ["site.conf"]


def test_a_closed_stdout_is_said_as_a_full_disk_is(tmp_path):
    """`portico keys create ... >&-` (a script or unit with no stdout): print() wrote nothing, without a word, and
    the flush after it was a traceback (AttributeError: 'NoneType' object has no attribute 'flush'), the key made
    and its secret lost; `keys list` the same traceback. Now as for a full disk: one line, exit 1."""
    data = ["--data-dir", str(tmp_path / "d")]

    def closed(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "server.cli", *data, *command], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=60, preexec_fn=lambda: os.close(1))

    created = closed("keys", "create", "--name", "lost", "--all-models")
    assert created.returncode == 1
    key_id = _portico(*data, "keys", "list").stdout.split("\t")[0]
    assert created.stderr == (f"portico: created key {key_id} (lost), but its secret could not be written (stdout is "
                              f"closed): revoke it (portico keys revoke {key_id}) and create another\n")
    listed = closed("keys", "list")
    assert (listed.returncode, listed.stderr) == (1, "portico: cannot write the output (stdout is closed)\n")


@pytest.mark.parametrize("args", [
    ("keys", "revoke", "{secret}", "{secret}"),  # two leaked secrets in one revoke: the second is an extra argument
    ("keys", "{secret}"),  # `revoke` left out
    ("keys", "create", "--name", "n", "--all-models", "--rpm", "{secret}"),
    ("keys", "rotate", "key_0000000000000000", "--grace", "{secret}"),
    ("usage", "--group-by", "{secret}"),
    ("usage", "--start", "{secret}"),
])
def test_a_secret_in_a_refused_command_line_is_not_echoed(tmp_path, args):
    """configuration.md and api.md: no error of the `portico` commands quotes a key; anything shaped like one reads
    `pk-[redacted]`. argparse's own refusals (an extra argument, an unknown command, a value that is no number) and
    `usage`'s option checks printed the secret whole, into a terminal's scrollback or a CI log."""
    secret = "pk-prod-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0U1v"
    done = _portico("--data-dir", str(tmp_path / "data"), *(arg.format(secret=secret) for arg in args))
    assert done.returncode == 2, done.stderr
    assert secret[8:20] not in done.stderr and "pk-[redacted]" in done.stderr, done.stderr


@pytest.mark.parametrize("args", [
    ("--data-dir", "{secret}", "keys", "list"),
    ("--data-dir", "{secret}", "usage"),
    ("--data-dir", "{secret}", "keys", "create", "--name", "n", "--all-models"),
    ("keys", "create", "--name", "n", "--all-models", "--data-dir", "keep/{secret}"),
    ("--config", "{secret}", "keys", "list"),
])
def test_a_secret_given_as_the_data_dir_or_config_is_refused_unechoed_and_nothing_is_made(tmp_path, args):
    """A secret pasted after --data-dir (or --config), where the command line's other refusals read pk-[redacted]:
    `no key store at pk-prod-A1b2...` quoted it whole, and `keys create` made a data dir named by it, a key store
    inside: the secret in plain text on disk, for as long as the directory stayed. Refused like any wrong option."""
    secret = "pk-prod-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0U1v"
    done = subprocess.run([sys.executable, "-m", "server.cli", *(arg.format(secret=secret) for arg in args)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 2, done.stderr
    assert secret[8:20] not in done.stderr + done.stdout and "pk-[redacted]" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is made in the working directory"
