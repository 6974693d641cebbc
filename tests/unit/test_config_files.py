"""A configuration file as a user writes it, and the command line around it: every mistake stops start-up with one
line naming where it is (exit code 2), never a traceback, a setting silently dropped or a gateway that misbehaves."""

from __future__ import annotations

import pytest

from server.cli import main
from server.config import ConfigError, load_config
from server.domain_keys import KeyLimits

ONE_MODEL = "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]"
UPSTREAM = "{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m}"


def _load(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A value of the wrong kind names its path (not "expected str, bytes or os.PathLike object, not int").
        (f"{ONE_MODEL}\ndata_dir: 5", r"c\.yaml: data_dir: a non-empty string, not 5"),
        (f"{ONE_MODEL}\ndata_dir: ''", r"c\.yaml: data_dir: a non-empty string, not ''"),
        (f"{ONE_MODEL}\ndata_dir: null", r"c\.yaml: data_dir: a non-empty string, not None"),
        # The PostgreSQL settings are numbers like the others: no text, no truth values, no fraction of a connection.
        (f"{ONE_MODEL}\nkeys: {{store_timeout_seconds: abc}}", r"keys\.store_timeout_seconds: a number, not 'abc'"),
        (f"{ONE_MODEL}\nkeys: {{store_timeout_seconds: '5'}}", r"keys\.store_timeout_seconds: a number, not '5'"),
        (f"{ONE_MODEL}\nkeys: {{store_timeout_seconds: null}}", r"keys\.store_timeout_seconds: a number, not None"),
        (f"{ONE_MODEL}\nkeys: {{pool_size: 2.7}}", r"keys\.pool_size: a whole number, not 2\.7"),
        (f"{ONE_MODEL}\nkeys: {{pool_size: true}}", r"keys\.pool_size: a whole number, not True"),
        (f"{ONE_MODEL}\nkeys: {{pool_size: 0}}", r"keys\.pool_size: a whole number of at least 1, not 0"),
        # YAML's .nan passes every `<` test and .inf is no duration: both are refused by name.
        (f"{ONE_MODEL}\ndrain_seconds: .nan", r"drain_seconds: a finite number, not nan"),
        (f"{ONE_MODEL}\nkeys: {{cache_seconds: .inf}}", r"keys\.cache_seconds: a finite number, not inf"),
        (f"{ONE_MODEL}\nkeys: {{store_timeout_seconds: .nan}}", r"keys\.store_timeout_seconds: a finite number"),
        (f"{ONE_MODEL}\nlimits: {{lease_seconds: .nan}}", r"limits\.lease_seconds: a finite number, not nan"),
        (f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {{kind: openai, base_url: "
         f"'http://127.0.0.1:9/v1', model: m, timeouts: {{read: .nan}}}}}}]",
         r"models\[0\]\.provider\.timeouts\.read: a positive number of seconds, .*not nan"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, cache: {ttl_seconds: .inf}}]",
         r"models\[0\]\.cache\.ttl_seconds: a positive number, not inf"),
        (f"models: [{{id: a, endpoint: /v1/chat/completions, deployments: [{{name: x, weight: .nan, "
         f"provider: {UPSTREAM}}}]}}]", r"deployments\[0\]\.weight: a positive number, not nan"),
        # owned_by is shown to callers in /v1/models: `owned_by:` left empty was the text "None".
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, owned_by: null}]",
         r"models\[0\]\.owned_by: a non-empty string, not None"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, owned_by: 5}]",
         r"models\[0\]\.owned_by: a non-empty string, not 5"),
        # An image link must lead somewhere: a scheme alone is no base URL.
        (f"{ONE_MODEL}\nlisten: {{public_base_url: 'http://'}}", r"listen\.public_base_url: an http:// or https://"),
        # Envoy binds an address, not a name: `localhost` failed only once Envoy started, after a key was made.
        (f"{ONE_MODEL}\nlisten: {{host: localhost}}", r"listen\.host: an IP address .*not 'localhost'"),
    ],
)
def test_config_mistakes_name_their_setting(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)


def test_a_model_path_that_is_no_gguf_file_is_a_configuration_error(tmp_path):
    """llama.cpp's "Failed to load model" came as a traceback (exit code 1) once the server was being built."""
    (tmp_path / "notes.txt").write_text("not a model\n")
    with pytest.raises(ConfigError, match=r"embedded\.model_path: .*notes\.txt.* is not a GGUF model file"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{model_path: {tmp_path / 'notes.txt'}}}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    assert _load(tmp_path, f"{ONE_MODEL}\nembedded: {{model_path: {tmp_path / 'm.gguf'}}}").embedded.model_path


def test_a_model_path_that_is_a_directory_says_so_not_no_such_file(tmp_path):
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match=r"embedded\.model_path: .*models' \(a directory\)$"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{model_path: {tmp_path / 'models'}}}")
    with pytest.raises(ConfigError, match=r"embedded\.model_path: .*absent\.gguf' \(no such file\)$"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{model_path: {tmp_path / 'absent.gguf'}}}")
    # '' is the working directory to the file system: it was refused as "not '' (a directory)".
    with pytest.raises(ConfigError, match=r"embedded\.model_path: the path of a GGUF model file, not ''$"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{model_path: ''}}")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "::"])
def test_listen_host_takes_ip_addresses(tmp_path, host):
    assert _load(tmp_path, f"{ONE_MODEL}\nlisten: {{host: '{host}'}}").host == host


@pytest.mark.parametrize("model_id", ["two words", "a,b", "tab\\there", "x" * 257])
def test_a_model_id_must_be_one_word(tmp_path, model_id):
    """A model id is granted in `keys create --models a,b`: one with a comma (or a space) could never be granted."""
    with pytest.raises(ConfigError, match=r"models\[0\]\.id: .* a model id is one word"):
        _load(tmp_path, f'models: [{{id: "{model_id}", endpoint: /v1/messages, provider: {{kind: llamacpp}}}}]')


@pytest.mark.parametrize("model_id", [".", ".."])
def test_a_model_id_that_http_clients_rewrite_as_a_path_is_refused(tmp_path, model_id):
    """GET /v1/models/.. is /v1 to every HTTP client (the SDKs refuse it outright): such a model could be listed
    and asked for, but never retrieved."""
    with pytest.raises(ConfigError, match=r"models\[0\]\.id: '\.+' is a path step"):
        _load(tmp_path, f'models: [{{id: "{model_id}", endpoint: /v1/messages, provider: {{kind: llamacpp}}}}]')


def test_model_ids_may_be_written_as_upstreams_name_models(tmp_path):
    text = "models: [{id: 'meta-llama/Llama-3.1-8B:ft.v2_x', endpoint: /v1/messages, provider: {kind: llamacpp}}]"
    assert _load(tmp_path, text).models[0].id == "meta-llama/Llama-3.1-8B:ft.v2_x"


def test_a_setting_written_twice_is_an_error_not_the_last_one_silently(tmp_path):
    text = f"{ONE_MODEL}\ndefault_max_tokens: 64\nembedded: {{threads: 4}}\ndefault_max_tokens: 128\n"
    with pytest.raises(ConfigError, match=r"c\.yaml: line 4: `default_max_tokens` is set twice"):
        _load(tmp_path, text)
    with pytest.raises(ConfigError, match=r"line 2: `threads` is set twice"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{threads: 4, threads: 8}}\n")
    # A merge key's values may be overridden: that is what it is for.
    text = "models:\n  - &a {id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}\n  - <<: *a\n    id: b\n"
    assert [m.id for m in _load(tmp_path, text).models] == ["a", "b"]


def test_a_key_that_is_a_mapping_or_a_list_is_an_error_naming_its_line(tmp_path):
    # YAML allows `{read: 1}: 2` and `[a]: 1`; Python cannot hold them as keys (a TypeError traceback before).
    with pytest.raises(ConfigError, match=r"c\.yaml: line 2: a setting's name must be a word, not a mapping"):
        _load(tmp_path, f"{ONE_MODEL}\n{{read: 1}}: 2\n")
    with pytest.raises(ConfigError, match=r"line 2: a setting's name must be a word, not a list"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{[threads]: 4}}\n")


def test_a_section_left_empty_takes_its_defaults(tmp_path):
    """`embedded:` with every line under it commented out is YAML's null: the defaults, not "must be a mapping"."""
    config = _load(tmp_path, f"{ONE_MODEL}\nlisten:\n  # port: 9000\nembedded:\nkeys:\nlimits:\n")
    assert (config.port, config.embedded.threads, config.key_cache_seconds) == (8080, 2, 1.0)
    assert config.limits.store == "memory"
    # A model's limits too (they were "limits.models.a must be a mapping"): it has none of its own.
    config = _load(tmp_path, f"{ONE_MODEL}\nlimits:\n  models:\n    a:\n      # requests_per_minute: 60\n")
    assert config.limits.models["a"] == KeyLimits()


def test_invalid_yaml_is_one_line_with_where(tmp_path):
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, f"{ONE_MODEL}\nlisten:\n\tport: 9000\n")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'c.yaml'}: not valid YAML at line 3, column 1: ")


def test_a_file_that_is_not_text_cannot_be_read(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe" + ONE_MODEL.encode("utf-16-le"))
    assert main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "keys", "list"]) == 2
    assert capsys.readouterr().err == f"portico: configuration error: cannot read config file {path}: not UTF-8 text\n"


# Only these make a data dir: usage and the other keys commands refuse a missing store (test_usage_report.py,
# test_keys_and_config.py).
@pytest.mark.parametrize("command", [["serve"], ["keys", "create", "--name", "n", "--all-models"]])
def test_a_data_dir_that_cannot_be_a_directory_is_one_line_and_exit_2(tmp_path, capsys, command):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    config = tmp_path / "c.yaml"
    config.write_text(f"{ONE_MODEL}\naccess_log: off\n")  # capsys's stderr is no file an access log could share
    for data_dir in (taken, taken / "sub"):
        assert main(["--config", str(config), "--data-dir", str(data_dir), *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"portico: configuration error: data_dir: cannot create {data_dir} (")
        assert err.count("\n") == 1
    # A file where the directory should be said "(File exists)": true of the path, but it reads as nothing wrong.
    main(["--config", str(config), "--data-dir", str(taken), *command])
    assert capsys.readouterr().err.endswith(f"cannot create {taken} (a file is there, not a directory)\n")


def test_serve_host_must_be_an_address(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--data-dir", str(tmp_path / "d"), "serve", "--host", "localhost"])
    assert stopped.value.code == 2
    assert "argument --host: listen.host: an IP address" in capsys.readouterr().err
    assert not (tmp_path / "d" / "keys.db").exists()  # nothing made before the mistake was found


def test_a_gguf_file_llama_cpp_cannot_load_stops_serve_in_one_line(tmp_path, capsys):
    """A file with GGUF's magic that llama.cpp still refuses (cut short, say): one line and exit code 2, not its
    ValueError's traceback with exit code 1."""
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + bytes(60))
    config = tmp_path / "c.yaml"
    config.write_text(f"{ONE_MODEL}\naccess_log: off\nembedded: {{model_path: {tmp_path / 'cut.gguf'}}}\n")
    assert main(["--config", str(config), "--data-dir", str(tmp_path / "d"), "serve", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"portico: configuration error: embedded.model_path: Failed to load model from file: "
                        f"{tmp_path / 'cut.gguf'}\n")


def test_a_context_llama_cpp_cannot_make_names_context_size(tmp_path, capsys):
    """A context_size llama.cpp cannot make room for: the message names the setting to change, and the size."""
    config = tmp_path / "c.yaml"
    config.write_text(f"{ONE_MODEL}\naccess_log: off\nembedded: {{context_size: 100000000}}\n")
    assert main(["--config", str(config), "--data-dir", str(tmp_path / "d"), "serve", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("portico: configuration error: embedded.context_size: llama.cpp cannot make a context of "
                        "100000000 tokens (Failed to create llama_context)\n")


def test_a_context_size_past_llama_cpps_counter_is_refused_not_wrapped(tmp_path):
    """llama.cpp counts the context in 32 bits: 4294967296 was taken as 0 (the model's own 8192) and 4294969344 as
    2048, while Portico checked prompts against the size configured; the gateway started as if all were well."""
    with pytest.raises(ConfigError, match=r"embedded\.context_size: a whole number from 1 to 4294967295, "
                                          r"not 4294967296"):
        _load(tmp_path, f"{ONE_MODEL}\nembedded: {{context_size: 4294967296}}\n")


def test_a_context_whose_buffers_cannot_be_allocated_names_context_size(tmp_path, capsys, monkeypatch):
    """llama-cpp-python sizes a token buffer by the context before llama.cpp is asked: where memory is not
    overcommitted that is numpy's MemoryError, which was a traceback."""
    import llama_cpp

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 16.0 GiB for an array with shape (4294967295,) and data type int32")

    monkeypatch.setattr(llama_cpp, "Llama", no_memory)
    config = tmp_path / "c.yaml"
    config.write_text(f"{ONE_MODEL}\naccess_log: off\nembedded: {{context_size: 4294967295}}\n")
    assert main(["--config", str(config), "--data-dir", str(tmp_path / "d"), "serve", "--metrics-port", "0"]) == 2
    assert capsys.readouterr().err == ("portico: configuration error: embedded.context_size: llama.cpp cannot make a "
                                       "context of 4294967295 tokens (Unable to allocate 16.0 GiB for an array with "
                                       "shape (4294967295,) and data type int32)\n")


def test_help_names_the_values_as_the_command_line_section_does(capsys):
    """configuration.md writes `portico [--config FILE] [--data-dir DIR] [--log-level LEVEL] serve [--host H] ...`."""
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "[--config FILE] [--data-dir DIR] [--log-level LEVEL]" in usage
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "[--host H] [--port P] [--admin-port P] [--metrics-port P] [--dev-key] [--workers N]" in usage


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8080"), ("::1", "http://[::1]:8080"),
                                           ("::", "http://[::]:8080")])
def test_the_listen_url_brackets_an_ipv6_host(tmp_path, host, url):
    """`Portico is listening on http://::1:8080` was no URL a client could use."""
    config = _load(tmp_path, f"{ONE_MODEL}\nlisten: {{host: '{host}'}}")
    assert config.listen_url == url
    assert config.base_url == url  # image links, without listen.public_base_url


def test_an_empty_data_dir_option_is_refused_not_the_working_directory(tmp_path, capsys, monkeypatch):
    """`--data-dir "$UNSET"` was Path("") — the working directory, whose files start-up then made owner-only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared.txt").write_text("x")
    (tmp_path / "shared.txt").chmod(0o644)
    with pytest.raises(SystemExit) as stopped:
        main(["--data-dir", "", "keys", "list"])
    assert stopped.value.code == 2
    assert "argument --data-dir: a directory path, not ''" in capsys.readouterr().err
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "keys.db").exists()


def test_an_empty_config_option_is_refused_by_its_name(tmp_path, capsys):
    """`--config "$UNSET"` was Path(""): "cannot read config file .: Is a directory", naming no option."""
    with pytest.raises(SystemExit) as stopped:
        main(["--config", "", "--data-dir", str(tmp_path / "d"), "serve"])
    assert stopped.value.code == 2
    assert "argument --config: a file path, not ''" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("keys: {pool_size: 8}", r"keys\.pool_size: only for a postgresql:// store"),
        ("keys: {store_timeout_seconds: 5}", r"keys\.store_timeout_seconds: only for a postgresql:// store"),
        ("limits: {lease_seconds: 10}", r"limits\.lease_seconds: only for a Redis store"),
        ("limits: {store_timeout_seconds: 2}", r"limits\.store_timeout_seconds: only for a Redis store"),
    ],
)
def test_a_store_setting_the_store_in_use_never_reads_is_refused(tmp_path, section, message):
    """A setting nothing would honour is refused, like keys.password_env with SQLite: `pool_size: 8` with SQLite, or
    a Redis timeout with the in-process limit store, did nothing, silently."""
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"{ONE_MODEL}\n{section}")
    postgres = "{store: 'postgresql://portico@db:5432/portico', pool_size: 8, store_timeout_seconds: 5}"
    assert _load(tmp_path, f"{ONE_MODEL}\nkeys: {postgres}").key_store.pool_size == 8
    redis = "{store: 'redis://127.0.0.1:6379/0', lease_seconds: 10, store_timeout_seconds: 2}"
    assert _load(tmp_path, f"{ONE_MODEL}\nlimits: {redis}").limits.lease_seconds == 10


REDIS = "store: 'redis://127.0.0.1:6379/0'"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        # Each names the one setting that is wrong, its bound and the value, as every other number does: these said
        # "usage: flush_seconds must be positive, batch_rows at least 1 and buffer_rows at least batch_rows".
        ("usage: {buffer_rows: 10}", r"usage\.buffer_rows: a whole number of at least 500, not 10$"),
        ("usage: {batch_rows: 0}", r"usage\.batch_rows: a whole number of at least 1, not 0$"),
        ("usage: {flush_seconds: 0}", r"usage\.flush_seconds: a positive number, not 0$"),
        ("tracing: {max_queue_size: 0}", r"tracing\.max_queue_size: a whole number of at least 1, not 0$"),
        ("tracing: {max_export_batch_size: 4096}",
         r"tracing\.max_export_batch_size: a whole number from 1 to 2048, not 4096$"),
        ("tracing: {export_delay_seconds: -1}", r"tracing\.export_delay_seconds: a positive number, not -1$"),
        ("tracing: {export_timeout_seconds: 0}", r"tracing\.export_timeout_seconds: a positive number, not 0$"),
        (f"limits: {{{REDIS}, lease_seconds: 0}}", r"limits\.lease_seconds: a positive number, not 0$"),
        (f"limits: {{{REDIS}, store_timeout_seconds: -0.5}}",
         r"limits\.store_timeout_seconds: a positive number, not -0\.5$"),
        # Past what the libraries under them take: the span exporter's thread died (OverflowError) and no trace
        # ever left; PostgreSQL refused every connection (statement_timeout "exceeds integer range").
        ("tracing: {export_delay_seconds: 1.0e+10}",
         r"tracing\.export_delay_seconds: a positive number, at most 86400, not 10000000000\.0$"),
        ("tracing: {export_timeout_seconds: 1.0e+10}",
         r"tracing\.export_timeout_seconds: a positive number, at most 86400, not 10000000000\.0$"),
        # A count past what the libraries under it take: OpenTelemetry's queue (an OverflowError traceback at start),
        # SQLite's integers (the hourly retention pass failed, a warning each time, and nothing was ever pruned).
        ("tracing: {max_queue_size: 1180591620717411303424}",
         r"tracing\.max_queue_size: a whole number of at least 1 and at most 2147483647, not 1180591620717411303424$"),
        ("usage: {retention_days: 1180591620717411303424}",
         r"usage\.retention_days: a whole number of at least 0 and at most 2147483647, not 1180591620717411303424$"),
        ("keys: {cache_size: 2147483648}", r"keys\.cache_size: a whole number of at least 1 and at most 2147483647"),
        # Redis expires the slots with an integer: 1.0e+300 made every request with a limit a 500 internal_error.
        (f"limits: {{{REDIS}, lease_seconds: 1.0e+300}}", r"limits\.lease_seconds: a positive number, at most 86400"),
        ("keys: {store: 'postgresql://portico@db:5432/portico', store_timeout_seconds: 3000000}",
         r"keys\.store_timeout_seconds: a positive number, at most 86400, not 3000000$"),
    ],
)
def test_a_number_out_of_its_range_names_that_one_setting(tmp_path, section, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"{ONE_MODEL}\n{section}")


TWO_DEPLOYMENTS = (f"models: [{{id: a, endpoint: /v1/chat/completions, "
                   f"deployments: [{{name: x, provider: {UPSTREAM}}}, {{name: y, provider: {UPSTREAM}}}], "
                   "health: HEALTH}]")


@pytest.mark.parametrize(
    ("health", "message"),
    [
        # A cooldown over 300 s alone said "max_cooldown_seconds must be at least cooldown_seconds", naming a setting
        # the file does not have, without the default that was too small.
        ("{cooldown_seconds: 600}",
         r"models\[0\]\.health\.max_cooldown_seconds: at least cooldown_seconds \(600\), not 300 \(its default\)$"),
        ("{cooldown_seconds: 20, max_cooldown_seconds: 10}",
         r"models\[0\]\.health\.max_cooldown_seconds: at least cooldown_seconds \(20\), not 10$"),
        ("{failure_rate: 1.5}", r"models\[0\]\.health\.failure_rate: a share of requests, above 0 and at most 1, "
                                r"not 1\.5$"),
        # A window of 1e-12 s made every outcome fail to be written to the shared health file (`--workers`).
        ("{window_seconds: 0.000000000001}",
         r"models\[0\]\.health\.window_seconds: from 1 to 86400 seconds, not 1e-12$"),
        ("{window_seconds: 100000}", r"models\[0\]\.health\.window_seconds: from 1 to 86400 seconds, not 100000$"),
        ("{cooldown_seconds: 1.0e+300, max_cooldown_seconds: 1.0e+300}",
         r"models\[0\]\.health\.max_cooldown_seconds: at most a year \(31536000\), not 1e\+300$"),
        # One second past the year read "at most a year (31536000), not 3.1536e+07": the value refused looked allowed.
        ("{max_cooldown_seconds: 31536001}",
         r"models\[0\]\.health\.max_cooldown_seconds: at most a year \(31536000\), not 31536001$"),
        ("{cooldown_seconds: 1234567.5}",
         r"models\[0\]\.health\.max_cooldown_seconds: at least cooldown_seconds \(1234567\.5\), not 300 "
         r"\(its default\)$"),
    ],
)
def test_a_health_setting_out_of_range_names_itself_and_its_value(tmp_path, health, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, TWO_DEPLOYMENTS.replace("HEALTH", health))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # `x or {}` took any false value for an empty section: `tracing: []` or `usage: false` ran on the defaults,
        # `price: 0` made a model free and `fallbacks: ""` gave it none, all without a word.
        (f"{ONE_MODEL}\ntracing: []", r"c\.yaml: tracing must be a mapping"),
        (f"{ONE_MODEL}\nusage: false", r"c\.yaml: usage must be a mapping"),
        (f"{ONE_MODEL}\nlimits: {{defaults: []}}", r"c\.yaml: limits\.defaults must be a mapping"),
        (f"{ONE_MODEL}\nlimits: {{models: 0}}", r"c\.yaml: limits\.models must be a mapping"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, price: 0}]",
         r"models\[0\]\.price must be a mapping"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, fallbacks: ''}]",
         r"models\[0\]\.fallbacks: a list of model ids"),
        (f"models: [{{id: a, endpoint: /v1/messages, provider: {{kind: openai, base_url: 'http://127.0.0.1:9/v1', "
         f"model: m, retry: []}}}}]", r"models\[0\]\.provider\.retry must be a mapping"),
        (f"models: [{{id: a, endpoint: /v1/messages, provider: {{kind: openai, base_url: 'http://127.0.0.1:9/v1', "
         f"model: m, timeouts: 0}}}}]", r"models\[0\]\.provider\.timeouts must be a mapping"),
        ("false", r"c\.yaml: the top level must be a mapping"),
        (f"{ONE_MODEL}\nkeys: {{store: 'postgresql://u@127.0.0.1:1/db', password_env: []}}",
         r"c\.yaml: keys\.password_env: the name of an environment variable, not \[\]"),
        # An empty name was taken as no password (api_key_env: '' is refused): the store then refused every login.
        (f"{ONE_MODEL}\nkeys: {{store: 'postgresql://u@127.0.0.1:1/db', password_env: ''}}",
         r"c\.yaml: keys\.password_env: the name of an environment variable, not ''$"),
        # Python refuses to read an integer of over 4300 digits: that was a ValueError traceback.
        (f"{ONE_MODEL}\ndefault_max_tokens: {'9' * 5000}", r"c\.yaml: not valid YAML: .*4300 digits.*: value has"),
        (f"{ONE_MODEL}\nlisten: {'[' * 5000}{']' * 5000}", r"c\.yaml: not valid YAML: nested too deeply$"),
        # A NUL cannot be in a path: the data dir or access log failed later with a traceback ("embedded null byte").
        (f"{ONE_MODEL}\naccess_log: \"a\\0b\"", r"c\.yaml: access_log: a path cannot hold a NUL character"),
        (f"{ONE_MODEL}\ndata_dir: \"a\\0b\"", r"c\.yaml: data_dir: a path cannot hold a NUL character"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_not_taken_as_empty(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as raised:
        _load(tmp_path, text)
    assert "\n" not in str(raised.value)


def test_sections_and_lists_left_empty_still_take_their_defaults(tmp_path):
    config = _load(tmp_path, "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, price: null, "
                             "fallbacks: null}]\ntracing:\nusage:\nlimits: {defaults: null, models: null}\n")
    assert config.models[0].fallbacks == () and not config.tracing.enabled and config.usage.batch_rows == 500


@pytest.mark.parametrize(("retry", "message"), [
    ("{initial_backoff: 10, max_backoff: 1}", r"retry\.max_backoff: at least initial_backoff \(10\), not 1$"),
    ("{initial_backoff: 20}", r"retry\.max_backoff: at least initial_backoff \(20\), not 8 \(its default\)$"),
    # Six significant digits read 1234567 as 1.23457e+06: not the value written.
    ("{initial_backoff: 1234567, max_backoff: 1234566}",
     r"retry\.max_backoff: at least initial_backoff \(1234567\), not 1234566$"),
])
def test_a_backoff_above_its_maximum_is_refused_not_cut_silently(tmp_path, retry, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {{kind: openai, "
                        f"base_url: 'http://127.0.0.1:9/v1', model: m, retry: {retry}}}}}]")


@pytest.mark.parametrize(("kind", "base_url", "message"), [
    # The anthropic SDK's base_url has no /v1: with it every request went to /v1/v1/messages, a 404 at request time
    # ("does not know the configured model") that named neither the path nor base_url.
    ("anthropic", "https://api.anthropic.com/v1", r"requests would go to https://api\.anthropic\.com/v1/v1/messages"),
    ("anthropic", "http://127.0.0.1:8000/v1/messages", r"/v1/messages/v1/messages"),
    ("openai", "http://127.0.0.1:8000/v1/chat/completions", r"/v1/chat/completions/chat/completions"),
    ("openai", "http://127.0.0.1:8000/v1/images/generations/", r"/v1/images/generations/chat/completions"),
])
def test_a_base_url_that_already_holds_the_request_path_is_refused(tmp_path, kind, base_url, message):
    with pytest.raises(ConfigError, match=rf"models\[0\]\.provider\.base_url: .*{message}") as raised:
        _load(tmp_path, f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {{kind: {kind}, "
                        f"base_url: '{base_url}', model: m}}}}]")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("kind", "base_url"), [
    ("anthropic", "https://api.anthropic.com"), ("anthropic", "https://gateway.example/anthropic"),
    ("openai", "http://127.0.0.1:8000/v1"), ("openai", "https://gateway.example/openai/v1"),
    ("openai", "http://127.0.0.1:8000"),  # a server without /v1 exists: not refused
])
def test_base_urls_as_the_sdks_take_them_are_accepted(tmp_path, kind, base_url):
    config = _load(tmp_path, f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {{kind: {kind}, "
                             f"base_url: '{base_url}', model: m}}}}]")
    assert config.models[0].deployments[0].provider.upstream.base_url == base_url


def test_a_path_beginning_with_a_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    """`data_dir: ~/portico` made a directory named `~` in the working directory, where `keys` run from anywhere
    else found no key store; the home directory is what a shell (and --data-dir) would have given."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = tmp_path / "home" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF....")
    config = _load(tmp_path, f"{ONE_MODEL}\ndata_dir: ~/portico\naccess_log: ~/access.log\n"
                             "embedded: {model_path: ~/m.gguf}\n")
    assert config.data_dir == tmp_path / "home" / "portico"
    assert config.access_log == str(tmp_path / "home" / "access.log")
    assert config.embedded.model_path == str(model)


@pytest.mark.parametrize("written", ["1e1", "1E1", "+1e1", "1.0e1", "1.e1", "100e-1"])
def test_a_number_in_exponent_notation_is_a_number(tmp_path, written):
    # YAML 1.1 (PyYAML's) reads `1e1` without a dot or an exponent sign as text: it was refused as "a number, not '1e1'"
    config = _load(tmp_path, f"{ONE_MODEL}\ndrain_seconds: {written}")
    assert config.drain_seconds == 10.0



@pytest.mark.parametrize(("text", "where"), [
    (f"{ONE_MODEL}\nlimits: {{defaults: {{1: 2, rpm: 3}}}}", r"limits\.defaults: unknown limit\(s\) 1, rpm;"),
    (f"{ONE_MODEL}\nlimits: {{defaults: {{on: 2}}}}", r"limits\.defaults: unknown limit\(s\) True;"),
    (f"{ONE_MODEL}\nusage: {{1: 2, flush: 3}}", r"usage: unknown setting\(s\) 1, flush;"),
    ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, price: {1: 2, input: 3}}]",
     r"models\[0\]\.price: unknown setting\(s\) 1;"),
    ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, cache: {1: 2, ttl: 3}}]",
     r"models\[0\]\.cache: unknown setting\(s\) 1, ttl;"),
    (f"models: [{{id: a, endpoint: /v1/messages, deployments: [{{name: x, provider: {UPSTREAM}, yes: 1, w: 2}}]}}]",
     r"models\[0\]\.deployments\[0\]: unknown setting\(s\) True, w;"),
    ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp, 1: 2, x: 3}}]",
     r"models\[0\]\.provider: a provider of kind `llamacpp` takes no settings, got 1, x$"),
    (TWO_DEPLOYMENTS.replace("HEALTH", "{1: 2, window: 3}"), r"models\[0\]\.health: unknown setting\(s\) 1, window;"),
    (f"{ONE_MODEL}\n\"a\\nb\": 1", r"c\.yaml: unknown setting\(s\) 'a\\nb';"),
])
def test_a_setting_name_yaml_reads_as_no_word_is_named_in_one_line(tmp_path, capsys, text, where):
    """YAML reads a name such as `1:` or `on:` as a number or a truth value: `price: {1: 2}` or an unknown name of each
    kind beside another was a TypeError traceback at `portico serve` ('<' not supported between 'str' and 'int'), or
    a line naming nothing; a quoted name holding a line break split the one-line message in two."""
    with pytest.raises(ConfigError, match=where) as raised:
        _load(tmp_path, text)
    assert "\n" not in str(raised.value)
    path = tmp_path / "c.yaml"
    assert main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portico: configuration error: ") and err.count("\n") == 1


@pytest.mark.parametrize(("text", "message"), [
    (f"models: [{{id: a, endpoint: /v1/messages, provider: {UPSTREAM[:-1]}, max_connections: 2147483648}}}}]",
     r"models\[0\]\.provider\.max_connections: a positive whole number, at most 2147483647, not 2147483648$"),
    (f"models: [{{id: a, endpoint: /v1/messages, provider: {UPSTREAM[:-1]}, retry: {{attempts: {10**20}}}}}}}]",
     rf"models\[0\]\.provider\.retry\.attempts: a positive whole number, at most 2147483647, not {10**20}$"),
    ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, cache: {max_entry_bytes: 2147483648}}]",
     r"models\[0\]\.cache\.max_entry_bytes: a positive whole number, at most 2147483647, not 2147483648$"),
    (TWO_DEPLOYMENTS.replace("HEALTH", f"{{consecutive_failures: {10**19}}}"),
     rf"models\[0\]\.health\.consecutive_failures: a positive whole number, at most 2147483647, not {10**19}$"),
    (TWO_DEPLOYMENTS.replace("HEALTH", "{min_requests: 2147483648}"),
     r"models\[0\]\.health\.min_requests: a positive whole number, at most 2147483647, not 2147483648$"),
])
def test_a_count_of_a_model_past_the_largest_whole_number_is_refused(tmp_path, text, message):
    """configuration.md: unless its row says otherwise a count or a size is from 1 to 2147483647, as the file's other
    counts are. A model's were taken whatever their size: a consecutive_failures past 2**63 could not be written to
    the shared health file (struct.error) once a trial answered."""
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)


@pytest.mark.parametrize("base_url", [
    # Gemini's and Azure's OpenAI-compatible URLs are often copied with their `?key=...`: the line quoted the key.
    "https://api.example.com/v1?key=AIzaSyQaConfigProbe0123456789",
    "https://api.example.com/v1#AIzaSyQaConfigProbe0123456789",
    # A bare `?` or `#` is no query urlsplit sees: requests went to `.../v1?/chat/completions`, the path lost.
    "https://api.example.com/v1?", "https://api.example.com/v1/#",
])
def test_a_base_url_with_a_query_or_fragment_is_refused_without_quoting_it(tmp_path, base_url):
    with pytest.raises(ConfigError, match=r"models\[0\]\.provider\.base_url: .*no query") as raised:
        _load(tmp_path, f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {{kind: openai, "
                        f"base_url: '{base_url}', model: m}}}}]")
    assert "AIzaSy" not in str(raised.value) and "https://api.example.com/v1" in str(raised.value)


def test_a_base_url_with_an_at_sign_in_its_path_is_sent_to_as_written(tmp_path):
    """An `@` in the path (no user or password) made the upstream's URL the text of the message that hides one."""
    config = _load(tmp_path, "models: [{id: a, endpoint: /v1/chat/completions, provider: {kind: openai, "
                             "base_url: 'https://gateway.example/@team/v1', model: m}}]")
    assert config.models[0].deployments[0].provider.upstream.base_url == "https://gateway.example/@team/v1"


def test_a_public_base_url_with_a_query_is_refused_without_quoting_it(tmp_path):
    """A link URL copied with a token in its query (`?token=...`) was quoted whole in the refusal."""
    with pytest.raises(ConfigError, match=r"listen\.public_base_url: .*no query") as raised:
        _load(tmp_path, f"{ONE_MODEL}\nlisten: {{public_base_url: 'https://gw.example/?token=tok0QaConfigProbe42'}}")
    assert "tok0QaConfigProbe42" not in str(raised.value) and "https://gw.example/" in str(raised.value)


def test_a_value_written_as_a_date_is_text_as_every_setting_takes_it(tmp_path):
    """YAML 1.1 reads 2026-01-01 as a date, which no setting takes: `created: 2025-10-01` was refused as "not
    datetime.date(2025, 10, 1)" (Python's words), a dated data_dir or model id was refused, and 2026-13-45 was
    "not valid YAML: month must be in 1..12". They are text now, refused or taken as text is."""
    with pytest.raises(ConfigError, match=r"models\[0\]\.created: a whole number, not '2025-10-01'$"):
        _load(tmp_path, "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, created: 2025-10-01}]")
    config = _load(tmp_path, "models: [{id: 2026-01-01, endpoint: /v1/messages, provider: {kind: llamacpp}}]\n"
                             "data_dir: 2026-13-45")
    assert (config.models[0].id, config.data_dir.name) == ("2026-01-01", "2026-13-45")
