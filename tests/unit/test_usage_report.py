"""`portico usage`: the ledger's totals as a table, from a real SQLite ledger through the CLI."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest

from server.cli import main
from server.usage.sqlite_ledger import SqliteLedger
from tests.unit.test_ledger_writer import row


def test_usage_prints_buckets_groups_and_the_total(tmp_path, capsys):
    ledger = SqliteLedger(tmp_path / "keys.db")
    day = int(time.time()) // 86_400 * 86_400
    ledger.write([
        row(1, at_ms=day * 1000 + 10, model="m", cost_micros=1_500_000),
        row(2, at_ms=day * 1000 + 20, model="n", key_id="key_b", cost_micros=250_000),
        row(3, at_ms=day * 1000 + 30, model="n", key_id="key_b", status=429, code="rate_limit_exceeded",
            upstream_attempts=0, input_tokens=0, output_tokens=0, cost_micros=0),
    ])
    ledger.close()
    assert main(["--data-dir", str(tmp_path), "usage", "--start", str(day), "--group-by", "model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("  ")[0:2] == ["bucket (UTC)", "model"]
    today = time.strftime("%Y-%m-%d", time.gmtime(day))
    assert lines[1].split() == [today, "m", "1", "1", "0", "10", "0", "5", "0", "$1.50"]
    assert lines[2].split() == [today, "n", "2", "1", "1", "10", "0", "5", "0", "$0.25"]
    assert lines[3].split() == ["total", "3", "2", "1", "20", "0", "10", "0", "$1.75"]

    assert main(["--data-dir", str(tmp_path), "usage", "--start", str(day), "--key", "key_b"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "$0.25"
    assert main(["--data-dir", str(tmp_path), "usage", "--group-by", "colour"]) == 2


def test_comma_separated_filters_filter_as_the_option_repeated(tmp_path, capsys):
    """`--group-by model,api_key_id` is comma-separated, and so is the API's `models=a,b` filter: `--model m,n`
    printed a total of nothing (no model id holds a comma), read as no usage."""
    ledger = SqliteLedger(tmp_path / "keys.db")
    day = int(time.time()) // 86_400 * 86_400
    ledger.write([row(1, at_ms=day * 1000 + 10, model="m", cost_micros=1_000_000),
                  row(2, at_ms=day * 1000 + 20, model="n", key_id="key_b", cost_micros=250_000),
                  row(3, at_ms=day * 1000 + 30, model="o", key_id="key_c", cost_micros=10_000)])
    ledger.close()
    for options in (["--model", "m,n"], ["--model", "m", "--model", "n"], ["--key", "key_a, key_b"]):
        assert main(["--data-dir", str(tmp_path), "usage", "--start", str(day), *options]) == 0
        assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "$1.25", options


def test_a_reversed_or_impossible_range_is_refused_like_the_api(tmp_path, capsys):
    """It printed an empty table with exit 0 where GET /v1/organization/usage/completions answers 400."""
    reversed_ = "--end must be after --start (the end is exclusive)"
    for dates, refusal in ((["--start", "2026-11-27", "--end", "2026-11-26"], reversed_),
                           (["--start", "2026-11-26", "--end", "2026-11-26"], reversed_),
                           (["--end", "99999999999999"], "--end must lie between 1970 and the year 10000")):
        assert main(["--data-dir", str(tmp_path), "usage", *dates]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"portico: {refusal}\n"


def test_an_end_alone_covers_the_seven_days_before_it(tmp_path, capsys):
    """`--end` without `--start` was refused ("--end must be after --start") once the end was over 7 days back: the
    default start was 7 days before now, not before the end the user gave."""
    ledger = SqliteLedger(tmp_path / "keys.db")
    day = (int(time.time()) // 86_400 - 30) * 86_400
    ledger.write([row(1, at_ms=day * 1000 + 10, model="m"), row(2, at_ms=(day - 8 * 86_400) * 1000, model="m")])
    ledger.close()
    assert main(["--data-dir", str(tmp_path), "usage", "--end", str(day + 86_400)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["total", "1"]


def test_a_date_written_without_dashes_is_that_date_not_seconds_in_1970(tmp_path, capsys):
    """`--start 20261101` read as unix seconds (1970-08-24): the whole ledger since then, with no word of it."""
    ledger = SqliteLedger(tmp_path / "keys.db")
    day = int(time.time()) // 86_400 * 86_400
    ledger.write([row(1, at_ms=day * 1000 + 10, model="m"), row(2, at_ms=(day - 3 * 86_400) * 1000, model="m")])
    ledger.close()
    compact = time.strftime("%Y%m%d", time.gmtime(day))
    assert main(["--data-dir", str(tmp_path), "usage", "--start", compact, "--bucket", "1d"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == time.strftime("%Y-%m-%d", time.gmtime(day))
    assert lines[-1].split()[:2] == ["total", "1"]


def test_a_start_after_now_names_the_start_not_an_end_nobody_gave(tmp_path, capsys):
    assert main(["--data-dir", str(tmp_path), "usage", "--start", str(int(time.time()) + 86_400)]) == 2
    assert capsys.readouterr().err == "portico: --start must be before now (the default --end)\n"


def test_an_end_in_the_first_week_of_1970_is_not_refused_for_a_start_nobody_gave(tmp_path, capsys):
    """`--end 86400` alone was refused with "--start must lie between 1970 and the year 10000": the default start,
    7 days before the end, fell before 1970. It starts at 1970 then, the earliest time the API takes too."""
    SqliteLedger(tmp_path / "keys.db").close()
    assert main(["--data-dir", str(tmp_path), "usage", "--end", "86400"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.splitlines()[-1].split()[:2] == ["total", "0"]


def test_a_group_named_twice_is_one_column_as_in_the_api(tmp_path, capsys):
    """The API reads group_by=model,model as one grouping; the table printed the model column twice."""
    ledger = SqliteLedger(tmp_path / "keys.db")
    day = int(time.time()) // 86_400 * 86_400
    ledger.write([row(1, at_ms=day * 1000 + 10, model="m")])
    ledger.close()
    assert main(["--data-dir", str(tmp_path), "usage", "--start", str(day), "--group-by", "model, model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("  ")[0:3] == ["bucket (UTC)", "model", "requests"]
    assert lines[1].split()[1:3] == ["m", "1"]


def test_a_locked_database_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """Another process holding keys.db's write lock past the busy timeout: `portico usage` raised sqlite3's
    OperationalError from the ledger's schema check, a traceback where a PostgreSQL outage gets one line."""
    SqliteLedger(tmp_path / "keys.db").close()
    monkeypatch.setattr("server.db.sqlite.BUSY_TIMEOUT_MS", 50)
    holder = sqlite3.connect(tmp_path / "keys.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert main(["--data-dir", str(tmp_path), "usage"]) == 1
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"portico: the usage ledger in {tmp_path / 'keys.db'} cannot be reached: "
                            "SQLite: database is locked\n")


@pytest.mark.parametrize("command", [["usage"], ["keys", "list"]])
def test_a_reader_that_stops_early_gets_no_traceback(tmp_path, command):
    """`portico usage | head -3`: the table's reader closed the pipe before the table was written, and the user saw
    Python's BrokenPipeError traceback under the lines they asked for."""
    ledger = SqliteLedger(tmp_path / "keys.db")
    ledger.write([row(1, at_ms=int(time.time() * 1000) - 1000)])
    ledger.close()
    assert main(["--data-dir", str(tmp_path), "keys", "create", "--name", "reader", "--all-models"]) == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before a line is written
    with os.fdopen(write, "wb") as stdout:
        done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(tmp_path), *command],
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=60)
    assert "Traceback" not in done.stderr and done.stderr == ""
    assert done.returncode == 1


def test_a_data_dir_without_a_ledger_is_refused_not_reported_as_no_usage(tmp_path, capsys):
    """Run from another directory (data_dir is relative: `data`) or with a mistyped --data-dir, `portico usage` made
    an empty keys.db there and printed a total of $0.00 with exit 0: no spend, to someone reconciling it."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for missing in (tmp_path / "not-the-data-dir", a_file):
        assert main(["--data-dir", str(missing), "usage"]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (f"portico: no usage ledger at {missing / 'keys.db'}: give the --data-dir (or "
                                "--config) that `portico serve` uses\n")
    assert not (tmp_path / "not-the-data-dir").exists()  # nothing made there
