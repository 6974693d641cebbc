"""Operations through the whole stack: probes without a key, the request id on every answer and in the access log,
a Prometheus scrape that labels traffic correctly, Envoy's own stats on its admin port, and a start that fails."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from portico.v1 import chat_service_pb2_grpc, model_pb2, model_service_pb2_grpc
from gateway.envoy import free_ports
from tests.e2e.conftest import Gateway, running_gateway
from tests.helpers import bearer, chat_request
from tests.upstream_support import UPSTREAM_KEY_ENV, write_config

HI = [{"role": "user", "content": "Hi"}]


def scrape(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def access_lines(gateway: Gateway) -> list[dict]:
    return [orjson.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith('{"ts":')]


def wait_for_line(gateway: Gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while not (found := [line for line in access_lines(gateway) if line["request_id"] == request_id]):
        assert time.monotonic() < deadline, f"no access-log line for {request_id}"
        time.sleep(0.05)
    (line,) = found
    return line


def new_key(gateway: Gateway, *options: str) -> tuple[str, str]:
    out = gateway.cli("keys", "create", "--name", "ops", "--all-models", "--env", "ops-tests", *options).stdout
    key_id = out.split()[2]
    return key_id, out.strip().splitlines()[-1]


def test_probes_answer_json_without_a_key(gateway):
    alive = httpx.get(f"{gateway.base_url}/healthz", timeout=60)
    assert (alive.status_code, alive.json()) == (200, {"status": "alive"})
    ready = httpx.get(f"{gateway.base_url}/readyz", timeout=60)
    assert ready.status_code == 200 and ready.headers["content-type"] == "application/json"
    assert ready.json() == {"status": "ready", "checks": {"model": "loaded", "keys": "ok", "limits": "ok"}}


def head_and_get(gateway: Gateway, path: str, headers: dict[str, str] | None = None) -> int:
    """HEAD then GET of `path` on one kept-alive connection (a body sent after the HEAD answer would be read as the
    start of the next answer): the same status and headers, content-length included, and no body. Returns the
    status."""
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=60) as client:
        head = client.head(path)
        get = client.get(path)
    assert head.status_code == get.status_code
    assert head.content == b""
    varying = {"date", "x-request-id", "request-id"}

    def kept(answer: httpx.Response) -> dict[str, str]:
        # An image link's max-age counts down to its expiry, as `date` moves: a second may pass between the two.
        return {k: re.sub(r"max-age=\d+", "max-age=N", v) if k == "cache-control" else v
                for k, v in answer.headers.items() if k not in varying}

    assert kept(head) == kept(get)
    return get.status_code


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/console/", "/console/app.js", "/v1/models"])
def test_head_answers_as_get_without_a_body(gateway, path):
    """Monitors and load balancers probe with HEAD."""
    assert head_and_get(gateway, path) != 404


def test_head_of_an_image_link_answers_as_its_get(gateway):
    """An image link's GET says how long the image is, and its HEAD gives the same headers (not content-length 0)."""
    made = httpx.post(f"{gateway.base_url}/v1/images/generations",
                      headers={"Authorization": f"Bearer {gateway.secret}"},
                      json={"model": "family-a-image-2", "prompt": "a buoy", "size": "256x256",
                            "response_format": "url"}, timeout=60)
    url = made.json()["data"][0]["url"]
    assert head_and_get(gateway, url.removeprefix(gateway.base_url)) == 200
    image = httpx.get(url, timeout=60)
    assert int(image.headers["content-length"]) == len(image.content) > 0


def test_an_image_requests_access_log_line_says_how_many_images_it_made(gateway):
    """An image request uses no tokens: its line said 0 and 0, and nothing of the images it made and cost."""
    made = httpx.post(f"{gateway.base_url}/v1/images/generations",
                      headers={"Authorization": f"Bearer {gateway.secret}"},
                      json={"model": "family-a-image-2", "prompt": "a buoy", "size": "256x256", "n": 3}, timeout=60)
    assert made.status_code == 200
    line = wait_for_line(gateway, made.headers["x-request-id"])
    assert (line["input_tokens"], line["output_tokens"], line["images"]) == (0, 0, 3)


@pytest.mark.parametrize(("path", "status"), [
    ("/v1/nope", 404), ("/v1/pk-dev-abc/chat", 404), ("/console-nope", 404),
    ("/v1/organization/costs?start_time=1&start_time=2", 400), ("/v1/organization/costs?line_items=1", 400),
    ("/v1/admin/keys/a?id=b", 400),
])
def test_head_of_a_refused_url_answers_as_its_get(gateway, path, status):
    """The GET's error headers, content-length included, whichever part refuses it (Envoy, the Lua shaper)."""
    assert head_and_get(gateway, path, {"Authorization": f"Bearer {gateway.secret}"}) == status


def test_request_id_goes_back_to_the_caller_and_into_the_access_log(gateway):
    key_id, secret = new_key(gateway)
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                          json={"model": "family-a-5.5", "messages": HI, "max_tokens": 2}, timeout=60)
    assert response.status_code == 200
    line = wait_for_line(gateway, response.headers["x-request-id"])
    assert (line["key_id"], line["key_env"], line["status"]) == (key_id, "ops-tests", 200)
    assert line["model"] == "family-a-5.5"
    assert line["endpoint"] == "/v1/chat/completions" and line["rpc"] == "ChatService/CreateChatCompletionHttpUnary"
    assert line["output_tokens"] == 2 == response.json()["usage"]["completion_tokens"]
    assert line["input_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert line["upstream_attempts"] == 1 and line["duration_ms"] >= line["upstream_ms"] > 0

    refused = httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": "Bearer pk-wrong"}, timeout=60)
    assert refused.status_code == 401
    line = wait_for_line(gateway, refused.headers["x-request-id"])
    assert (line["key_id"], line["status"], line["code"]) == (None, 401, "invalid_api_key")


def test_grpc_callers_get_the_request_id_as_metadata(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        _, call = models.ListModels.with_call(model_pb2.ListModelsRequest(), metadata=bearer(gateway.secret))
        request_id = dict(call.initial_metadata())["x-request-id"]
        with pytest.raises(grpc.RpcError) as caught:
            models.ListModels(model_pb2.ListModelsRequest(), metadata=bearer("pk-wrong"))
    assert wait_for_line(gateway, request_id)["rpc"] == "ModelService/ListModels"
    failed = {**dict(caught.value.initial_metadata() or ()), **dict(caught.value.trailing_metadata())}
    assert wait_for_line(gateway, failed["x-request-id"])["status"] == 401


@pytest.mark.parametrize("shape", ["a key", "too long"])
def test_a_grpc_caller_gets_back_its_own_request_id_as_the_access_log_keeps_it(gateway, shape):
    """A gRPC caller's own x-request-id comes back cut to 128 characters and without a key pasted there, as the
    access log (and the usage ledger) keep it, so the id it got finds its line: it came back as sent."""
    tail = secrets.token_urlsafe(24)
    chosen = f"mine-pk-dev-{tail}" if shape == "a key" else "r" * 300
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel)
        _, call = models.ListModels.with_call(model_pb2.ListModelsRequest(),
                                              metadata=[*bearer(gateway.secret), ("x-request-id", chosen)])
        with pytest.raises(grpc.RpcError) as caught:
            models.ListModels(model_pb2.ListModelsRequest(), metadata=[*bearer("pk-wrong"), ("x-request-id", chosen)])
        stream = chat_service_pb2_grpc.ChatServiceStub(channel).StreamChatCompletion(
            chat_request(max_tokens=2), metadata=[*bearer(gateway.secret), ("x-request-id", chosen)])
        assert [chunk.choices[0].finish_reason for chunk in stream][-1] == "length"
        assert stream.code() == grpc.StatusCode.OK
    answered, refused = dict(call.initial_metadata()), dict(caught.value.trailing_metadata())
    got = answered["x-request-id"]
    assert tail not in got and len(got) <= 128
    assert got == answered["request-id"] == refused["x-request-id"] == refused["request-id"]
    assert dict(stream.initial_metadata())["x-request-id"] == got
    deadline = time.monotonic() + 5
    while sorted(line["status"] for line in access_lines(gateway) if line["request_id"] == got) != [200, 200, 401]:
        assert time.monotonic() < deadline, f"no access-log lines for {got!r}"
        time.sleep(0.05)


def test_a_scrape_shows_each_request_with_its_labels(gateway):
    key_id, secret = new_key(gateway, "--rpm", "3")
    headers = {"Authorization": f"Bearer {secret}", "x-api-key": secret}
    chat = {"model": "family-a-5.4", "messages": HI, "max_tokens": 3}
    message = {"model": "family-b-opus-4-7", "messages": HI, "max_tokens": 3}
    before = scrape(gateway)
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert client.post("/v1/messages", json=message).status_code == 200
        assert client.post("/v1/messages", json=message).status_code == 429  # the fourth request in a minute
        assert client.post("/v1/chat/completions", json={**chat, "model": "no-such-model"}).status_code == 404
    after = scrape(gateway)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    chat_ok = dict(endpoint="/v1/chat/completions", model="family-a-5.4", status="200", code="")
    assert delta("portico_requests_total", **chat_ok) == 2
    messages_ok = dict(endpoint="/v1/messages", model="family-b-opus-4-7", status="200", code="")
    assert delta("portico_requests_total", **messages_ok) == 1
    assert delta("portico_requests_total", endpoint="/v1/messages", model="family-b-opus-4-7", status="429",
                 code="rate_limit_exceeded") == 1
    # The unknown model is refused before any limit is consulted; its name never becomes a label.
    assert delta("portico_requests_total", endpoint="/v1/chat/completions", model="", status="404",
                 code="model_not_found") == 1
    assert not any("no-such-model" in str(labels) for _, labels in after)
    assert delta("portico_rate_limit_rejections_total", limit="requests_per_minute", scope="key") == 1
    assert value(after, "portico_output_tokens_total", model="family-a-5.4", key_id=key_id) == 6
    assert value(after, "portico_output_tokens_total", model="family-b-opus-4-7", key_id=key_id) == 3
    assert value(after, "portico_input_tokens_total", model="family-a-5.4", key_id=key_id) > 10
    assert delta("portico_time_to_first_token_seconds_count", endpoint="/v1/chat/completions",
                 model="family-a-5.4") == 2
    assert delta("portico_request_duration_seconds_count", endpoint="/v1/messages", model="family-b-opus-4-7") == 2
    assert delta("portico_upstream_duration_seconds_count", model="family-b-opus-4-7") == 1
    # The embedded model is each model's one deployment, named after its kind, as in the usage ledger's rows.
    assert delta("portico_deployment_requests_total", model="family-a-5.4", deployment="llamacpp") == 2
    assert delta("portico_deployment_requests_total", model="family-b-opus-4-7", deployment="llamacpp") == 1
    assert value(after, "portico_requests_in_flight", endpoint="/v1/chat/completions") == 0


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """operations.md's Metrics table: each metric's name -> (type, labels)."""
    section = (Path(__file__).parents[2] / "docs" / "operations.md").read_text().split("## Metrics")[1]
    table = {}
    for row in section.split("## Files")[0].splitlines():
        if row.startswith("| `portico_"):
            names, kind, labels = (cell.strip() for cell in row.strip("|").split("|")[:3])
            for name in re.findall(r"`(portico_\w+)`", names):
                table[name] = (kind, set(re.findall(r"`(\w+)`", labels)))
    return table


def documented_families(gateway: Gateway, *, workers: bool = False) -> dict:
    """The families of a scrape after a chat request, each checked against operations.md's table: its documented
    type, labels (on every sample) and a HELP text, no undocumented family, histograms whose buckets rise to an +Inf
    bucket equal to their count. With one process every family is there, each counter and histogram with its
    `_created` series; the summed series of `--workers N` have none (and a family nothing counted yet is absent)."""
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    chat = {"model": "family-a-5.4", "messages": HI, "max_tokens": 2}
    assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=chat, headers=headers,
                      timeout=60).status_code == 200
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=30).text
    documented = documented_metrics()
    assert len(documented) == 19  # the table read as a whole
    families, created = {}, set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # one process: the time each series started (operations.md)
            created.add(family.name.removesuffix("_created"))
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        families[name] = family
        kind, labels = documented[name]  # a KeyError is an undocumented family
        assert (family.type, bool(family.documentation)) == (kind, True), name
        buckets: dict[tuple, list[tuple[float, float]]] = {}
        counts = {}
        for s in family.samples:
            assert set(s.labels) - {"le"} == labels, (name, s)
            series = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name.endswith("_bucket"):
                buckets.setdefault(series, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[series] = s.value
        for series, rising in buckets.items():
            rising.sort()
            assert rising[-1][0] == float("inf") and rising[-1][1] == counts[series], (name, series)
            assert [v for _, v in rising] == sorted(v for _, v in rising), (name, series)
    assert families["portico_request_duration_seconds"].samples  # the request's, checked above
    if workers:
        assert not created and families.keys() <= documented.keys()
    else:
        assert families.keys() == documented.keys()
        assert "portico_requests" in created and "portico_request_duration_seconds" in created
    return families


def test_the_scrape_holds_the_documented_metrics_and_nothing_else(gateway):
    documented_families(gateway)


def test_envoy_stats_on_its_admin_port(gateway):
    stats = httpx.get(f"http://127.0.0.1:{gateway.admin_port}/stats/prometheus", timeout=60).text
    assert 'envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="portico"}' in stats
    listeners = httpx.get(f"http://127.0.0.1:{gateway.admin_port}/listeners", timeout=60).text
    assert f"127.0.0.1:{gateway.port}" in listeners


def test_envoys_admin_port_serves_reads_and_changes_nothing(gateway):
    """Envoy's admin interface was this loopback port: any local user could stop the gateway (/quitquitquit), fail
    its health check, drain it, or raise its log level to one that prints credentials. It now listens on a socket
    only the service's user may open, and the port serves its reads."""
    admin = f"http://127.0.0.1:{gateway.admin_port}"
    for path in ("/quitquitquit", "/healthcheck/fail", "/drain_listeners", "/logging?level=debug"):
        refused = httpx.post(admin + path, timeout=60)
        assert (refused.status_code, refused.headers["allow"]) == (405, "GET, HEAD"), path
    assert httpx.get(admin + "/quitquitquit", timeout=60).status_code != 200  # Envoy's own rule: changes are POSTs
    info = httpx.get(admin + "/server_info", timeout=60).json()
    assert info["state"] == "LIVE"
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        answer = client.get("/healthz")
        assert answer.status_code == 200 and answer.headers.get("connection") != "close"  # no drain under way
    logging = httpx.get(admin + "/logging", timeout=60).text
    assert "debug" not in logging.split("active loggers:")[-1]
    run_dir = Path(info["command_line_options"]["config_path"]).parent
    socket_path = run_dir / "envoy-admin.sock"
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600 and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert socket_path.is_socket()
    assert f"changes through the socket {socket_path}" in gateway.log_path.read_text()  # where an operator finds it


def test_serve_on_a_port_in_use_exits_1_and_says_so(tmp_path):
    data_dir = tmp_path / "busy-port-data"
    data_dir.mkdir()
    (data_dir / "envoy.log").write_text("a line from an earlier run\n")  # Envoy's log is appended to across runs
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        admin_port, metrics_port = free_ports(2)
        log_path = tmp_path / "busy-port-data.log"  # beside the data dir, where the session's log scan looks
        with open(log_path, "w") as log:
            done = subprocess.run(
                [sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), "serve", "--port", str(port),
                 "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)],
                stdout=subprocess.PIPE, stderr=log, text=True, timeout=90,
            )
    errors = log_path.read_text()
    assert done.returncode == 1
    assert f"cannot bind '127.0.0.1:{port}': Address already in use" in errors
    assert "earlier run" not in errors  # only what this start went through
    assert "Portico is listening" not in done.stdout


@pytest.mark.parametrize("workers", ["1", "3"])
def test_a_temp_dir_too_long_for_unix_sockets_is_one_line_and_exit_2(tmp_path, workers):
    """The run directory, with the servers' unix sockets, is made under TMPDIR; a socket path holds at most 107
    bytes, and a long TMPDIR was a grpc traceback after the model had loaded."""
    temp = tmp_path / ("t" * 80)
    temp.mkdir()
    port, admin_port, metrics_port, redis_port = free_ports(4)
    config = tmp_path / "portico.yaml"  # workers need a shared limit store; it is never reached here
    config.write_text(Path("server/default.yaml").read_text().replace(
        "store: memory ", f"store: redis://127.0.0.1:{redis_port}/0 "))
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir", str(tmp_path / "data"), "serve",
         "--port", str(port),
         "--admin-port", str(admin_port), "--metrics-port", str(metrics_port), "--workers", workers],
        capture_output=True, text=True, timeout=90, env={**os.environ, "TMPDIR": str(temp)},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"TMPDIR: {temp} is too long" in done.stderr
    assert not list(temp.iterdir())  # nothing made there


def test_a_temp_dir_that_is_missing_is_one_line_and_exit_2(tmp_path):
    """Python passes over a TMPDIR it cannot use for /tmp without a word: the run directory, with the sockets,
    went where the operator had not put it."""
    temp = tmp_path / "no-such-dir"
    port, admin_port, metrics_port = free_ports(3)
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "--data-dir", str(tmp_path / "data"), "serve", "--port", str(port),
         "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)],
        capture_output=True, text=True, timeout=90, env={**os.environ, "TMPDIR": str(temp)},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"portico: configuration error: TMPDIR: {temp} is not a directory this user may write in "
                           "(no such directory): make it one, or unset TMPDIR to use /tmp\n")
    assert not (tmp_path / "data").exists()  # nothing made


@pytest.mark.parametrize(("damage", "exit_code", "start"), [
    ("image-link.key", 2, "portico: configuration error: data_dir: "),
    ("images", 2, "portico: configuration error: data_dir: "),
    ("envoy.log/", 1, "ERROR portico: Envoy did not start: cannot open its log "),
])
def test_a_damaged_data_dir_is_one_line(tmp_path, damage, exit_code, start):
    """A short image-link.key (its own message said to delete it), a file where the images directory goes, or a
    directory where Envoy's log goes, was a traceback after the model had loaded."""
    data = tmp_path / "data"
    data.mkdir()
    if damage.endswith("/"):
        damage = damage.rstrip("/")
        (data / damage).mkdir()
    else:
        (data / damage).write_bytes(b"short")
    port, admin_port, metrics_port = free_ports(3)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "server.cli", "--data-dir", str(data), "serve", "--port", str(port),
             "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)],
            capture_output=True, text=True, timeout=90,
        )
    finally:
        if (data / damage).is_dir():
            (data / damage).rmdir()  # no directory named *.log for the session's log scan
    assert done.returncode == exit_code and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if str(data / damage) in line]
    assert start in line and (line.startswith(start) or exit_code == 1), line


def test_a_second_gateway_on_the_first_ones_admin_port_never_says_it_is_listening(gateway, tmp_path):
    """The readiness probe asked the first gateway's Envoy on that admin port, took its 200 for its own Envoy's,
    and printed "Portico is listening" before Envoy's bind failure stopped it."""
    port, metrics_port = free_ports(2)
    log_path = tmp_path / "same-admin-port-data.log"
    with open(log_path, "w") as log:
        second = subprocess.run(
            [sys.executable, "-m", "server.cli", "--data-dir", str(tmp_path / "same-admin-port-data"), "serve",
             "--port", str(port), "--admin-port", str(gateway.admin_port), "--metrics-port", str(metrics_port)],
            stdout=subprocess.PIPE, stderr=log, text=True, timeout=90,
        )
    assert second.returncode == 1
    assert "Portico is listening" not in second.stdout
    assert f"cannot bind '127.0.0.1:{gateway.admin_port}': Address already in use" in log_path.read_text()
    assert httpx.get(f"{gateway.base_url}/healthz", timeout=60).status_code == 200


def test_a_second_gateway_on_the_same_port_refuses_to_start(gateway, tmp_path):
    """Envoy binds with SO_REUSEPORT by default: a second gateway on the same port came up and took half the
    traffic, answering it with keys of its own (401s for the first gateway's callers). A first start that fails so
    makes no development key: it showed the secret once in the failed run's output, and the next start none."""
    data_dir = tmp_path / "second-gateway-data"
    admin_port, metrics_port = free_ports(2)
    log_path = tmp_path / "second-gateway-data.log"
    with open(log_path, "w") as log:
        second = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), "serve", "--port", str(gateway.port),
             "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
        try:
            printed, _ = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it came up beside the first one
            second.terminate()
            second.wait(timeout=60)
            raise
    assert second.returncode == 1
    assert f"cannot bind '127.0.0.1:{gateway.port}': Address already in use" in log_path.read_text()
    assert "pk-" not in printed and "development key" not in printed
    assert httpx.get(f"{gateway.base_url}/healthz", timeout=60).status_code == 200
    with running_gateway(data_dir) as third:  # it fails unless this first start to come up prints the key
        assert third.secret


def test_a_first_start_in_front_of_upstreams_says_how_to_make_a_key(tmp_path):
    """No development key is made by itself in front of upstreams (it would spend real money): serve says instead
    how to make one, since every request needs a key; a store that has keys gets no such line."""
    provider = "{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m}"
    models = f"  - {{id: up, endpoint: /v1/chat/completions, provider: {provider}}}\n"
    config = write_config(tmp_path, models)
    with running_gateway(tmp_path / "data", config=config, dev_key=False) as gateway:
        hint = [line for line in gateway.printed if "has no keys yet" in line]
        assert hint and "--dev-key" in hint[0]
        assert not gateway.secret
        # The command to run, with this gateway's catalog and key store (it said `--config FILE`, to fill in): as
        # given, from another directory and this shell's PATH, which need not hold the venv's `portico` (make serve
        # runs .venv/bin/portico; it said `portico`, which no shell found).
        command = shlex.split(re.search(r"`(.*? keys create .*?)`", hint[0]).group(1).replace("MODEL,...", "up"))
        assert command[1:5] == ["--config", str(config.resolve()), "--data-dir", str((tmp_path / "data").resolve())]
        subprocess.run(command, check=True, capture_output=True, timeout=30, cwd=tmp_path.parent)
    with running_gateway(tmp_path / "data", config=config, dev_key=False) as again:
        assert not [line for line in again.printed if "has no keys yet" in line]


def test_an_access_log_file_left_readable_is_made_private_at_start(tmp_path):
    """It holds key ids and envs: like the data dir's files, an access log an older version (or a touch) left
    readable by others loses their access when the gateway starts, not only one it creates itself."""
    log = tmp_path / "access.log"
    log.write_text("")
    log.chmod(0o644)
    provider = "{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m}"
    config = write_config(tmp_path, f"  - {{id: up, endpoint: /v1/chat/completions, provider: {provider}}}\n")
    config.write_text(config.read_text() + f"access_log: {log}\n")
    with running_gateway(tmp_path / "data", config=config, dev_key=False):
        assert log.stat().st_mode & 0o777 == 0o600


def test_an_absurd_worker_count_is_one_line_and_exit_2(tmp_path):
    """`--workers 100000` on a 2-core machine tried to start 100,000 server processes, each loading the gateway."""
    port, admin_port, metrics_port, redis_port = free_ports(4)
    config = tmp_path / "portico.yaml"  # workers need a shared limit store; it is never reached here
    config.write_text(Path("server/default.yaml").read_text().replace(
        "store: memory ", f"store: redis://127.0.0.1:{redis_port}/0 "))
    most = 4 * len(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir", str(tmp_path / "data"), "serve",
         "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port),
         "--workers", "100000"],
        capture_output=True, text=True, timeout=90,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"portico: --workers 100000 is more than {most} ")


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _event(kind: str, **fields) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def test_the_first_token_is_the_first_content_a_tool_call_or_thinking_included(tmp_path):
    """An answer that is only a tool call (an agent's usual turn), or that thinks before it writes, has its first
    token when that content arrives: before, a tool call had none (no histogram sample, `first_token_ms` null) and
    thinking counted only from the text after it."""
    from tests.e2e.conftest import upstream_gateway
    from tests.upstream_double import Cue, UpstreamDouble

    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_call = [_chunk({"role": "assistant", "content": None}), _chunk({"tool_calls": [call]}),
                 _chunk({}, "tool_calls"), b"data: [DONE]\n\n"]
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
               "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    thinking = [_event("message_start", message=message),
                _event("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
                _event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "hmm"}),
                _event("content_block_stop", index=0),
                _event("content_block_start", index=1, content_block={"type": "text", "text": ""}),
                _event("content_block_delta", index=1, delta={"type": "text_delta", "text": "hi"}),
                _event("content_block_stop", index=1),
                _event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 2}),
                _event("message_stop")]
    double = UpstreamDouble().start()
    common = f"api_key_env: {UPSTREAM_KEY_ENV}, model: m"
    models = (f"  - {{id: tools, endpoint: /v1/chat/completions, provider: {{kind: openai, base_url: '{double.url}', "
              f"{common}}}}}\n  - {{id: thinks, endpoint: /v1/messages, provider: {{kind: anthropic, base_url: "
              f"'{double.url.removesuffix('/v1')}', {common}}}}}\n")
    try:
        with upstream_gateway(tmp_path, models) as gateway, httpx.Client(
                base_url=gateway.base_url, headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=30) as client:
            asked = {"messages": HI, "max_tokens": 50, "stream": True}
            ids = []
            for path, model, frames in (("/v1/chat/completions", "tools", tool_call),
                                        ("/v1/messages", "thinks", thinking)):
                double.cue(Cue(frames=frames, frame_delay=0.3))  # 0.3 s before each frame after the first
                answer = client.post(path, json={**asked, "model": model})
                assert answer.status_code == 200
                ids.append(answer.headers["x-request-id"])
            samples = scrape(gateway)
            # The tool call is the second frame (0.3 s); the thinking delta the third (0.6 s), the text the sixth.
            for request_id, endpoint, model, first in zip(ids, ("/v1/chat/completions", "/v1/messages"),
                                                         ("tools", "thinks"), (300, 600)):
                line = wait_for_line(gateway, request_id)
                assert line["first_token_ms"] is not None and first - 50 < line["first_token_ms"] < first + 250, line
                assert value(samples, "portico_time_to_first_token_seconds_count", endpoint=endpoint,
                             model=model) == 1
    finally:
        double.stop()
