"""The console's files: served from what the build put in the directory, and nothing else."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from server.console import ConsoleFiles
from server.console.build import build
from server.errors import NotFound


def test_serves_the_built_files_by_path_with_their_content_type(tmp_path):
    (tmp_path / "vendor").mkdir()
    (tmp_path / "index.html").write_text("<!doctype html>")
    (tmp_path / "app.js").write_text("export {}")
    (tmp_path / "vendor" / "lib.css").write_text("a {}")
    (tmp_path / "notes.md").write_text("not a web file")
    files = ConsoleFiles(tmp_path)
    assert files.get("").data == b"<!doctype html>" and files.get("/").content_type.startswith("text/html")
    assert files.get("app.js").content_type == "text/javascript; charset=utf-8"
    assert files.get("vendor/lib.css").data == b"a {}"
    for path in ("notes.md", "../index.html", "vendor/../app.js", "missing.js", "/etc/passwd"):
        with pytest.raises(NotFound):
            files.get(path)


def test_a_server_without_a_build_answers_not_found_naming_the_fix(tmp_path):
    with pytest.raises(NotFound, match="make install"):
        ConsoleFiles(tmp_path / "absent").get("")


def test_the_build_holds_the_app_and_its_pinned_chart_library(tmp_path):
    from server.console.build import SOURCES

    if not all(source.exists() for source, _ in SOURCES):
        pytest.skip("npm ci has not run in server/console/web (make install does it)")
    build(tmp_path / "console")
    files = ConsoleFiles(tmp_path / "console")
    page = files.get("").data.decode()
    assert '<script type="module" src="/console/app.js">' in page
    assert b"uPlot" in files.get("vendor/uPlot.esm.js").data


def test_the_built_page_is_newer_than_what_it_was_built_from(tmp_path, monkeypatch):
    """build/console/index.html is `make install`'s target: a copy keeping its source's older time would leave it
    out of date for ever, so every `make serve` would run `npm ci` (the npm registry) and the build again."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "index.html").write_text("<!doctype html>")
    os.utime(source / "index.html", (1_000_000_000, 1_000_000_000))  # checked out long before the build
    monkeypatch.setattr("server.console.build.SOURCES", ((source, Path(".")),))
    started = time.time()
    build(tmp_path / "console")
    assert (tmp_path / "console" / "index.html").stat().st_mtime >= started - 1


def test_the_sign_in_page_names_a_command_that_makes_an_admin_key_as_written(tmp_path, capsys):
    """The sign-in form tells a user without an admin key how to make one; pasted as shown, it must work (it said
    `portico keys create --admin`, which argparse refuses for want of --name and the grants)."""
    import re
    import shlex

    from server.cli import main

    app = (Path(__file__).parents[2] / "server" / "console" / "web" / "src" / "app.js").read_text()
    commands = re.findall(r'h\("code", \{\}, "(portico keys create[^"]*)"\)', app)
    assert len(commands) == 1
    argv = shlex.split(commands[0])[1:]
    assert main([*argv, "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--data-dir", str(tmp_path)]) == 0
    assert "\tactive admin\t" in capsys.readouterr().out
