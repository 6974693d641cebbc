"""Catalog rules and configuration errors (the key store and the authenticator: tests/db/test_key_store.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.envoy import free_ports
from server.catalog import Catalog
from server.config import ConfigError, load_config
from server.domain_keys import ApiKey, KeyLimits
from server.errors import ModelNotFound


def test_catalog_rules():
    catalog = Catalog(load_config().models)
    key = ApiKey(id="k", name="n", all_models=False, models=frozenset({"family-b-opus-4-8"}))
    assert catalog.resolve(key, "family-b-opus-4-8", "/v1/messages").id == "family-b-opus-4-8"
    with pytest.raises(ModelNotFound, match="/v1/messages"):
        catalog.resolve(key, "family-b-opus-4-8", "/v1/chat/completions")
    with pytest.raises(ModelNotFound, match="does not exist"):
        catalog.resolve(key, "family-a-5.5", "/v1/chat/completions")


ONE_MODEL = "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]"


def test_limits_config():
    limits = load_config().limits
    assert limits.defaults == KeyLimits(requests_per_minute=600, tokens_per_minute=1_000_000, concurrent_requests=32)
    assert limits.store == "memory" and limits.models == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: []", "non-empty list"),
        ("models: [{id: a, endpoint: /v1/nope, provider: {kind: llamacpp}}]", "endpoint must be one of"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: magic}}]", "kind must be one of"),
        ("models: [{id: a, endpoint: /v1/messages}]", "`provider` is required"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}},"
         " {id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]", "listed twice"),
        ("listen: {port: http}\nmodels: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]", "http"),
        ("models: [", "not valid YAML"),
        (f"{ONE_MODEL}\nlimits: {{defaults: {{rpm: 5}}}}", "unknown limit"),
        (f"{ONE_MODEL}\nlimits: {{defaults: {{requests_per_minute: 0}}}}", "from 1 to 2147483647, or null"),
        (f"{ONE_MODEL}\nlimits: {{models: {{b: {{requests_per_minute: 5}}}}}}", "'b' is not a model"),
        (f"{ONE_MODEL}\nlimits: {{store: sqlite}}", "limits.store"),
        (f"{ONE_MODEL}\nlimits: {{store: 'redis://h/0', on_store_error: maybe}}", "on_store_error"),
        (f"{ONE_MODEL}\nlimits: {{lease_seconds: 0}}", "lease_seconds"),
        # A typo anywhere is an error naming where it is, never a setting silently ignored.
        (f"{ONE_MODEL}\ndefault_max_token: 64", r"c\.yaml: unknown setting\(s\) default_max_token; known: listen"),
        (f"{ONE_MODEL}\nlisten: {{prot: 9000}}", r"listen: unknown setting\(s\) prot; known: host, port"),
        (f"{ONE_MODEL}\nembedded: {{thread: 4}}", r"embedded: unknown setting\(s\) thread; known: context_size"),
        (f"{ONE_MODEL}\nkeys: {{cache_second: 5}}", r"keys: unknown setting\(s\) cache_second; known: cache_seconds"),
        (f"{ONE_MODEL}\nlimits: {{stor: memory}}", r"limits: unknown setting\(s\) stor"),
        # Every section lists what it knows, tracing too (it listed nothing).
        (f"{ONE_MODEL}\ntracing: {{endpoint: 'http://h:4318'}}",
         r"tracing: unknown setting\(s\) endpoint; known: otlp_endpoint, sample_ratio"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, fallback: [b]}]",
         r"models\[0\]: unknown setting\(s\) fallback"),
        # A value of the wrong type names its path too, and a model file that is not there is a configuration error.
        (f"{ONE_MODEL}\nlisten: {{port: eighty}}", r"listen\.port: a whole number, not 'eighty'"),
        (f"{ONE_MODEL}\ndrain_seconds: thirty", r"c\.yaml: drain_seconds: a number, not 'thirty'"),
        (f"{ONE_MODEL}\nembedded: {{context_size: big}}", r"embedded\.context_size: a whole number, not 'big'"),
        (f"{ONE_MODEL}\nkeys: {{cache_seconds: [1]}}", r"keys\.cache_seconds: a number, not \[1\]"),
        (f"{ONE_MODEL}\ntracing: {{sample_ratio: half}}", r"tracing\.sample_ratio: a number, not 'half'"),
        (f"{ONE_MODEL}\nembedded: {{model_path: /nonexistent/model.gguf}}",
         r"embedded\.model_path: the path of a GGUF model file, not '/nonexistent/model.gguf' \(no such file\)"),
        # A number out of its range stops start-up too, rather than a traceback or a gateway that misbehaves.
        (f"{ONE_MODEL}\nmetrics_port: 70000", r"c\.yaml: metrics_port: a whole number from 0 to 65535, not 70000"),
        # More threads than llama.cpp can run (GGML_MAX_N_THREADS): the first request would kill the process.
        (f"{ONE_MODEL}\nembedded: {{threads: 100000}}", r"embedded\.threads: a whole number from 1 to 512, not 100000"),
        (f"{ONE_MODEL}\nlisten: {{port: 0}}", r"listen\.port: a whole number from 1 to 65535, not 0"),
        (f"{ONE_MODEL}\nenvoy_admin_port: 65536", r"envoy_admin_port: a whole number from 1 to 65535"),
        (f"{ONE_MODEL}\ndrain_seconds: -1", r"drain_seconds: a number of at least 0, not -1"),
        (f"{ONE_MODEL}\nembedded: {{instances: 0}}", r"embedded\.instances: a whole number of at least 1, not 0"),
        (f"{ONE_MODEL}\ndefault_max_tokens: 0", r"default_max_tokens: a whole number from 1 to 2147483647, not 0"),
        (f"{ONE_MODEL}\nkeys: {{cache_seconds: -1}}", r"keys\.cache_seconds: a number of at least 0"),
        (f"{ONE_MODEL}\nkeys: {{cache_size: 0}}", r"keys\.cache_size: a whole number of at least 1"),
        (f"{ONE_MODEL}\nkeys: {{rotation_grace_seconds: -5}}", r"keys\.rotation_grace_seconds: a whole number from 0 to 315360000, not -5"),
        # Values of the wrong kind elsewhere are named too, never a traceback or a setting taken as something else.
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, created: soon}]",
         r"models\[0\]\.created: a whole number, not 'soon'"),
        ("models: [{id: '', endpoint: /v1/messages, provider: {kind: llamacpp}}]", r"models\[0\]\.id: a non-empty string"),
        (f"{ONE_MODEL}\naccess_log: 5", r"c\.yaml: access_log: a non-empty string, not 5"),
        (f"{ONE_MODEL}\nlisten: {{host: ''}}", r"listen\.host: a non-empty string"),
        (f"{ONE_MODEL}\nlisten: {{public_base_url: portico.example.com}}", r"listen\.public_base_url: an http:// or https://"),
    ],
)
def test_config_mistakes_are_clear(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize(("option", "value"), [("--port", "70000"), ("--admin-port", "0"), ("--metrics-port", "-5")])
def test_serve_port_options_out_of_range_are_usage_errors(tmp_path, capsys, option, value):
    from server.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--data-dir", str(tmp_path / "d"), "serve", option, value])
    assert stopped.value.code == 2
    assert f"argument {option}: a port from" in capsys.readouterr().err


def test_an_access_log_that_cannot_be_opened_stops_serve_with_exit_2(tmp_path, capsys):
    from server.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: {tmp_path / 'no-such-dir' / 'access.log'}\n")
    assert main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve"]) == 2
    assert capsys.readouterr().err == (f"portico: configuration error: access_log: cannot open "
                                       f"{tmp_path / 'no-such-dir' / 'access.log'} (No such file or directory)\n")


def test_the_global_options_may_follow_the_command(tmp_path, capsys):
    """Issue 5 and the README write `portico serve --config FILE`: the options before the command work after it too."""
    from server.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: {tmp_path / 'no-such-dir' / 'access.log'}\n")
    assert main(["serve", "--config", str(path), "--data-dir", str(tmp_path / "d"), "--log-level", "error"]) == 2
    assert "access_log: cannot open" in capsys.readouterr().err
    create = ["create", "--name", "n", "--all-models"]
    assert main(["keys", *create, "--data-dir", str(tmp_path / "d2")]) == 0
    assert (tmp_path / "d2" / "keys.db").exists()
    # Before the command, as documented, and a later one wins.
    assert main(["--data-dir", str(tmp_path / "d3"), "keys", *create, "--data-dir", str(tmp_path / "d4")]) == 0
    assert (tmp_path / "d4" / "keys.db").exists() and not (tmp_path / "d3" / "keys.db").exists()


@pytest.mark.parametrize("command", [["list"], ["get", "key_0123456789abcdef"], ["update", "key_0123456789abcdef",
                                     "--rpm", "5"], ["rotate", "key_0123456789abcdef"], ["revoke", "pk-dev-x"]])
def test_a_data_dir_without_a_key_store_is_refused_not_listed_as_no_keys(tmp_path, capsys, command):
    """A mistyped --data-dir (or the relative `data` read from another directory): `portico keys list` made a new
    keys.db there, and a directory for it, and printed no keys with exit 0, as if every key were gone; the others
    said the key did not exist. Now one line naming the file, exit 1, and nothing made (as `portico usage`)."""
    from server.cli import main

    missing = tmp_path / "not-the-data-dir"
    assert main(["--data-dir", str(missing), "keys", *command]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"portico: no key store at {missing / 'keys.db'}: give the --data-dir (or --config) "
                            "that `portico serve` uses\n")
    assert not missing.exists()


@pytest.mark.parametrize("written", ["off", "'off'", "OFF", "stdout", "stderr"])
def test_access_log_takes_its_documented_words_as_written(tmp_path, written):
    """YAML reads a bare `off` as false; the table's `access_log: off` must still mean no access log."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: {written}\n")
    assert load_config(path).access_log == written.strip("'").lower()


@pytest.mark.parametrize("content", [b"not a model", b"GGUF" + bytes(60)], ids=["text", "empty-gguf"])
def test_a_model_path_that_is_no_gguf_model_stops_serve_with_exit_2(tmp_path, content):
    """A file that is there but is not a model llama.cpp can load is a mistake in the file like a missing one: a
    message naming the setting, not a traceback."""
    model = tmp_path / "model.gguf"
    model.write_bytes(content)
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nembedded: {{model_path: {model}}}\naccess_log: 'off'\n")
    port, admin_port = free_ports(2)
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--config", str(path), "--data-dir", str(tmp_path / "d"), "serve",
         "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # serve would say it swept a killed serve's run directory
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("portico: configuration error: ") and result.stderr.count("\n") == 1
    assert "embedded.model_path: " in result.stderr and str(model) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_key_store_that_cannot_be_opened_stops_serve_with_the_file_and_the_cause(tmp_path):
    """A server process whose keys.db could not be opened printed only the callers' words ("The key store is
    unreachable; retry shortly."): no file, no cause, nothing for an operator to act on."""
    (tmp_path / "data" / "keys.db").mkdir(parents=True)  # a directory where the database file belongs
    done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(tmp_path / "data"), "serve",
                           "--port", "1", "--admin-port", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (f"portico: the key store in {tmp_path / 'data' / 'keys.db'} cannot be "
                                            "reached: SQLite: unable to open database file")


def test_the_cli_writes_out_a_names_directional_controls_as_the_console_does(tmp_path, capsys):
    """A key name holding a right-to-left override printed raw in `portico keys list` reversed the rest of the
    operator's terminal line (the state, env and grants after it) and disguised the name (Trojan Source). The
    console writes such characters out as <U+202E>; the CLI now does too, in every line that shows a name."""
    from server.cli import main

    data = ["--data-dir", str(tmp_path / "d")]
    name = "billing\u202e\u2066ops"
    assert main([*data, "keys", "create", "--name", name, "--all-models"]) == 0
    created = capsys.readouterr().out
    key_id = created.split()[2]
    assert main([*data, "keys", "list"]) == 0
    assert main([*data, "keys", "get", key_id]) == 0
    assert main([*data, "keys", "update", key_id, "--rpm", "5"]) == 0
    assert main([*data, "keys", "rotate", key_id]) == 0
    assert main([*data, "keys", "revoke", key_id]) == 0
    printed = created + capsys.readouterr().out
    assert "\u202e" not in printed and "\u2066" not in printed
    assert printed.count("billing<U+202E><U+2066>ops") == 6


def test_keys_list_prints_one_line_per_key_whatever_its_name_holds(tmp_path, capsys):
    """A key name holding a line or paragraph separator (U+2028, U+2029: a name pasted from a document, or sent
    through the admin API, which takes them) split its row of `portico keys list` in two for a script reading the
    rows with str.splitlines(), as Python's does: the second half read as a row of its own. They are written out
    as <U+2028>, as direction controls are."""
    from server.cli import main

    data = ["--data-dir", str(tmp_path / "d")]
    for name in ("first\u2028half", "para\u2029graph", "plain"):
        assert main([*data, "keys", "create", "--name", name, "--all-models"]) == 0
    capsys.readouterr()
    assert main([*data, "keys", "list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 3 and all(row.startswith("key_") for row in rows), rows
    assert "first<U+2028>half" in rows[0] + rows[1] + rows[2]
    assert "para<U+2029>graph" in rows[0] + rows[1] + rows[2]
