"""The benchmark's `--only` (docs/performance.md): a name outside its list is refused before anything starts, rather
than running nothing and exiting 0 as if the run had passed."""

from __future__ import annotations

import pytest

from bench import handler, run


@pytest.mark.parametrize("only", ["jsn", "json,strem", "JSON"])
def test_bench_refuses_an_unknown_run(only, capsys):
    with pytest.raises(SystemExit) as exit:
        run.parse_args(["--only", only])
    assert exit.value.code == 2
    assert "direct,json,stream,messages,latency,streams" in capsys.readouterr().err


def test_bench_takes_its_runs():
    assert run.parse_args(["--only", "json,latency"]).only == "json,latency"


@pytest.mark.parametrize("only", ["json", "JSON,strem"])
def test_bench_handler_refuses_an_unknown_kind(only, capsys):
    with pytest.raises(SystemExit) as exit:
        handler.main(["--only", only])  # refused while parsing: no mock or key is started
    assert exit.value.code == 2
    assert "JSON,stream,messages" in capsys.readouterr().err


# A value no run can use is refused while parsing, in one line, before a gateway starts: `--duration 0` used to run
# every wrk for nothing and report it in the table minutes later, `--duration -1` hung until wrk's timeout, and
# bench.handler's `--requests 0` or `--concurrency 0` ended in a ZeroDivisionError traceback.
@pytest.mark.parametrize("option, value", [
    ("--workers", "0"), ("--duration", "0"), ("--duration", "-1"), ("--connections", "0"), ("--threads", "0"),
    ("--rate", "0"), ("--rate", "-5"), ("--latency-seconds", "-1"), ("--streams", "-1"), ("--rounds", "0"),
    ("--floor", "nan"), ("--floor", "inf"), ("--rate", "nan"),
])
def test_bench_refuses_a_value_out_of_range(option, value, capsys):
    with pytest.raises(SystemExit) as exit:
        run.parse_args([option, value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err


def test_bench_refuses_more_threads_than_connections(capsys):
    with pytest.raises(SystemExit) as exit:
        run.parse_args(["--threads", "4", "--connections", "2"])
    assert exit.value.code == 2
    assert "--threads" in capsys.readouterr().err


def test_bench_refuses_a_json_file_it_could_not_write(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        run.parse_args(["--json", str(tmp_path / "no-such-directory" / "results.json")])
    assert exit.value.code == 2
    assert "--json" in capsys.readouterr().err


def test_bench_takes_zeros_that_mean_skip(tmp_path):
    args = run.parse_args(["--streams", "0", "--latency-seconds", "0", "--floor", "0,upstream",
                           "--json", str(tmp_path / "results.json")])
    assert (args.streams, args.latency_seconds, args.floor) == (0, 0.0, [0.0, "upstream"])


@pytest.mark.parametrize("options", [["--requests", "0"], ["--concurrency", "0"], ["--requests", "-3"],
                                     ["--requests", "10", "--concurrency", "16"]])
def test_bench_handler_refuses_counts_out_of_range(options, capsys):
    with pytest.raises(SystemExit) as exit:
        handler.main(options)  # refused while parsing: no mock or key is started
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "argument --" in err or "--requests" in err


# --peers runs its own set (interleaved JSON and stream rounds, then the open streams): an option it would ignore is
# refused, not a 5,000-stream run after `--peers --only json`.
@pytest.mark.parametrize("options", [["--only", "json"], ["--litellm"], ["--litellm", "only"]])
def test_bench_peers_refuses_what_it_would_ignore(options, capsys):
    with pytest.raises(SystemExit) as exit:
        run.parse_args(["--peers", *options])
    assert exit.value.code == 2
    assert "--peers" in capsys.readouterr().err
