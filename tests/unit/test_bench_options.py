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
