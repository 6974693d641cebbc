"""The `portico` command as an operator runs it from a unit file or a script (no shell to expand `~`, output to a
file on a disk that may be full): what configuration.md's "Command line" promises."""

from __future__ import annotations

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
