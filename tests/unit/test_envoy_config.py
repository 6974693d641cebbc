"""envoy.yaml as Envoy reads it: valid by hand (`envoy -c envoy.yaml` from the repository root) and as rendered, and
the route that sends the anthropic SDK's /v1/models calls to AnthropicModelService transcodes like every other."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import LUA_PARTS, envoy_binary, http_manager, load_template, render_config, repo_root
from server.app import MAX_RECEIVE_BYTES
from server.config_cors import CorsSettings
from server.services.undecodable import MAX_REQUEST_BYTES

TRANSCODER = "envoy.filters.http.grpc_json_transcoder"


def validate(path) -> subprocess.CompletedProcess:
    return subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          cwd=repo_root(), capture_output=True, text=True, timeout=60)


def transcoders(config: dict) -> tuple[dict, dict]:
    """The filter's transcoder settings and the anthropic models route's."""
    hcm = http_manager(config)
    (filter_config,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == TRANSCODER]
    (route,) = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
                if r.get("metadata", {}).get("filter_metadata", {}).get("envoy.filters.http.lua", {}).get("anthropic")]
    return filter_config, route["typed_per_filter_config"][TRANSCODER]


def test_envoy_accepts_the_template_and_the_rendered_config(tmp_path):
    checked = validate(repo_root() / "envoy.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rendered = render_config(load_template(), listen_port=18080, admin_port=19901, upstreams=["unix:/tmp/p.sock"],
                             admin_socket=Path("/tmp/admin.sock"),
                             descriptor_set=DESCRIPTOR_SET, lua_dir=repo_root() / "gateway" / "lua")
    (tmp_path / "data").mkdir()  # for Envoy's access log
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(rendered))
    checked = validate(tmp_path / "envoy.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert {c["proto_descriptor"] for c in transcoders(rendered)} == {str(DESCRIPTOR_SET.resolve())}


def test_every_lua_part_is_in_the_script_envoy_runs():
    """A part left out of LUA_PARTS would be missing from the rendered filter without a word."""
    assert sorted(LUA_PARTS) == sorted(path.name for path in (repo_root() / "gateway" / "lua").glob("*.lua"))


def test_the_anthropic_models_route_transcodes_like_the_filter_but_for_its_service():
    filter_config, route_config = transcoders(load_template())
    assert route_config["services"] == ["portico.v1.AnthropicModelService"]
    assert "portico.v1.ModelService" in filter_config["services"]
    assert {**route_config, "services": None} == {**filter_config, "services": None}


def test_grpc_requests_are_capped_where_envoy_caps_rest_bodies():
    """Native gRPC passes Envoy unbuffered; the server caps its messages at the same size (docs/api.md, 413)."""
    hcm = http_manager(load_template())
    (buffer,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.buffer"]
    assert buffer["max_request_bytes"] == MAX_REQUEST_BYTES < MAX_RECEIVE_BYTES


def _idle_timeout(tmp_path, models_yaml: str) -> str:
    from server.serving import _envoy_config
    from tests.upstream_support import load_upstream_config

    return http_manager(_envoy_config(load_upstream_config(tmp_path, models_yaml), ["unix:/tmp/p.sock"], tmp_path))[
        "stream_idle_timeout"]


def _model(timeouts: str = "{}") -> str:
    return ("  - {id: m, endpoint: /v1/chat/completions, provider: {kind: openai, base_url: 'http://127.0.0.1:9/v1',"
            f" model: x, timeouts: {timeouts}}}}}\n")


def test_envoy_never_cuts_a_silence_a_model_is_allowed(tmp_path):
    """A non-streamed answer is silent until the model has finished (`timeouts.answer`, 600 s by default, plus the
    retries' 30 s): Envoy's 300 s cut such answers half-way with a 504 the server then logged as the caller's 499."""
    assert _idle_timeout(tmp_path, "  - {id: e, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}\n") \
        == "300s"  # the embedded model only: envoy.yaml's limit
    assert _idle_timeout(tmp_path, _model()) == "635s"
    assert _idle_timeout(tmp_path, _model("{answer: 30, read: 900}")) == "935s"
    assert _idle_timeout(tmp_path, _model("{answer: 100, read: 10}")) == "300s"


def test_a_long_silence_is_a_duration_envoy_reads(tmp_path):
    """`timeouts.answer: 1000000` was rendered `1.00004e+06s`: Envoy refused its configuration and serve stopped with
    exit code 1 and a page of JSON."""
    assert _idle_timeout(tmp_path, _model("{answer: 1000000}")) == "1000035s"
    assert _idle_timeout(tmp_path, _model("{answer: 600.25}")) == "635.25s"

    from server.serving import _envoy_config
    from tests.upstream_support import load_upstream_config

    rendered = _envoy_config(load_upstream_config(tmp_path, _model("{answer: 31536000}")), ["unix:/tmp/p.sock"], tmp_path)
    (tmp_path / "data").mkdir()  # for Envoy's access log
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(rendered))
    checked = validate(tmp_path / "envoy.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_listening_on_every_ipv6_address_takes_ipv4_callers_too(tmp_path):
    """configuration.md: `listen.host` `0.0.0.0` or `::` for every interface. Envoy binds `::` IPv6-only unless told
    otherwise: with `::`, a caller at 127.0.0.1 (or any IPv4 address) got connection refused."""
    def address(host: str) -> dict:
        return render_config(load_template(), listen_port=18080, admin_port=19901, upstreams=["unix:/tmp/p.sock"],
                             admin_socket=Path("/tmp/admin.sock"),
                             descriptor_set=DESCRIPTOR_SET, lua_dir=repo_root() / "gateway" / "lua",
                             listen_host=host)

    for host in ("::", "0:0:0:0:0:0:0:0"):
        assert address(host)["static_resources"]["listeners"][0]["address"]["socket_address"]["ipv4_compat"] is True
    for host in ("127.0.0.1", "0.0.0.0", "::1"):
        assert "ipv4_compat" not in address(host)["static_resources"]["listeners"][0]["address"]["socket_address"]
    (tmp_path / "data").mkdir()  # for Envoy's access log
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(address("::")))
    checked = validate(tmp_path / "envoy.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _rendered(**options) -> dict:
    return render_config(load_template(), listen_port=18080, admin_port=19901, upstreams=["unix:/tmp/p.sock"],
                             admin_socket=Path("/tmp/admin.sock"),
                         descriptor_set=DESCRIPTOR_SET, lua_dir=repo_root() / "gateway" / "lua", **options)


def test_without_cors_the_config_has_no_trace_of_it():
    """configuration.md `cors:`: off by default, and then nothing of it is in Envoy's way (the hot path unchanged)."""
    assert _rendered(cors=None) == _rendered()
    text = yaml.safe_dump(_rendered()).lower()
    assert "envoy.filters.http.cors" not in text and "access-control" not in text and "vary" not in text


def test_cors_is_envoys_filter_first_with_its_policy_on_the_api_routes_only(tmp_path):
    """First: it answers a preflight before the Lua filter would refuse an OPTIONS, and is the last to see an answer,
    so errors the Lua filter shaped carry access-control-allow-origin too (tests/e2e/test_cors.py)."""
    rendered = _rendered(cors=CorsSettings(allow_origins=("https://app.example.com",)))
    hcm = http_manager(rendered)
    assert hcm["http_filters"][0]["name"] == "envoy.filters.http.cors"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    with_policy = [route["match"] for route in routes if "envoy.filters.http.cors" in
                   route.get("typed_per_filter_config", {})]
    assert with_policy == [{"path_separated_prefix": "/v1/models", "headers": [{"name": "anthropic-version",
                                                                                 "present_match": True}]},
                           {"prefix": "/v1/"}]
    matches = [route["match"] for route in routes]
    api = matches.index({"prefix": "/v1/"})
    assert matches[api - 2:api] == [{"path_separated_prefix": "/v1/admin"},
                                    {"path_separated_prefix": "/v1/organization"}]
    (tmp_path / "data").mkdir()  # for Envoy's access log
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(rendered))
    checked = validate(tmp_path / "envoy.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
