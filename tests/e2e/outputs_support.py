"""Reading one request in each of the gateway's outputs: its access-log line, its usage-ledger row (GET
/v1/organization/requests), its trace (a real OTLP receiver) and what moved in the Prometheus metrics; `agree` checks
they name the same request id, key, model, status, code, tokens and cost (operations.md, Metrics, Logs, Traces, Usage
ledger). The gateway: `portico serve` with real Envoy, Redis limits, and models on an upstream that fails on cue."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Gateway, running_gateway
from tests.otlp_receiver import OtlpReceiver
from tests.upstream_double import UpstreamDouble
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV

HI = [{"role": "user", "content": "Hi"}]
RETRY = "{attempts: 3, initial_backoff: 0.02, max_backoff: 0.05, total_seconds: 5}"
CHAT = "/v1/chat/completions"


@dataclass
class Setup:
    gateway: Gateway
    receiver: OtlpReceiver
    double: UpstreamDouble
    key_id: str
    secret: str
    redis: object


def config(directory, collector: str, upstream: str, redis_url: str):
    common = f"kind: openai, base_url: '{upstream}', api_key_env: {UPSTREAM_KEY_ENV}"
    anthropic_common = f"kind: anthropic, base_url: '{upstream.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    path = directory / "agree.yaml"
    path.write_text(f"""\
tracing: {{otlp_endpoint: '{collector}', export_delay_seconds: 0.05, export_timeout_seconds: 1}}
usage: {{flush_seconds: 0.1}}
limits: {{store: '{redis_url}', store_timeout_seconds: 0.5, models: {{capped: {{requests_per_minute: 1}}}}}}
models:
  - id: priced
    endpoint: /v1/chat/completions
    provider: {{{common}, model: main-model, retry: {RETRY}}}
    price: {{input: 2, output: 10}}
    fallbacks: [backup]
  - id: backup
    endpoint: /v1/chat/completions
    provider: {{{common}, model: backup-model, retry: {{attempts: 1}}}}
    price: {{input: 5, output: 20}}
  - id: solo
    endpoint: /v1/chat/completions
    provider: {{{common}, model: solo-model, retry: {RETRY}, timeouts: {{read: 0.5, answer: 0.5}}}}
    price: {{input: 1, output: 1}}
  - id: cached
    endpoint: /v1/chat/completions
    provider: {{{common}, model: cached-model}}
    price: {{input: 1, output: 3}}
    cache: {{}}
  - id: msgs
    endpoint: /v1/messages
    provider: {{{anthropic_common}, model: claude-up, retry: {RETRY}}}
    price: {{input: 3, output: 15}}
  - id: img
    endpoint: /v1/images/generations
    provider: {{kind: dev-image}}
    price: {{image: 0.04}}
  - id: up-img
    endpoint: /v1/images/generations
    provider: {{{common}, model: gpt-image-1, retry: {RETRY}}}
    price: {{image: 0.01}}
  - id: local
    endpoint: /v1/chat/completions
    provider: {{kind: llamacpp}}
    price: {{input: 1, output: 2}}
  - id: capped
    endpoint: /v1/chat/completions
    provider: {{{common}, model: capped-model}}
  - id: secret-model
    endpoint: /v1/chat/completions
    provider: {{{common}, model: hidden}}
""")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, redis):
    directory = tmp_path_factory.mktemp("agree")
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    receiver, double = OtlpReceiver().start(), UpstreamDouble().start()
    try:
        path = config(directory, receiver.url, double.url, redis.url)
        with running_gateway(directory / "data", *os.environ.get("AGREE_SERVE_ARGS", "").split(),
                             config=path) as gateway:
            gateway = dataclasses.replace(gateway, config=path)
            models = "priced,solo,cached,msgs,img,up-img,local,capped"
            out = gateway.cli("keys", "create", "--name", "agree", "--models", models,
                              "--env", "agree-env", "--rpm", "1000").stdout
            key_id, secret = out.split()[2], out.strip().splitlines()[-1]
            yield Setup(gateway, receiver, double, key_id, secret, redis)
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        receiver.stop()
        double.stop()


def scrape(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def changed(before: dict, after: dict, *names: str) -> dict:
    """The samples of these metrics that moved, with how much."""
    return {key: after[key] - before.get(key, 0.0) for key in after
            if key[0] in names and after[key] != before.get(key, 0.0)
            and dict(key[1]).get("endpoint") != "/v1/organization/requests"}  # the test's own reads


def access_line(gateway: Gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        lines = [orjson.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith('{"ts":')]
        found = [line for line in lines if line["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, (request_id, found)
            return found[0]
        time.sleep(0.05)


def ledger_rows(setup: Setup, request_id: str, expect: int = 1) -> list[dict]:
    deadline = time.monotonic() + 5
    while True:
        answer = httpx.get(f"{setup.gateway.base_url}/v1/organization/requests", timeout=30,
                           params={"start_time": 0, "limit": 1000},
                           headers={"authorization": f"Bearer {setup.secret}"})
        assert answer.status_code == 200, answer.text
        rows = answer.json()["data"]
        found = [row for row in rows if row["request_id"] == request_id]
        if len(found) >= expect or time.monotonic() > deadline:
            assert len(found) == expect, (request_id, found, rows[:2])
            return found
        time.sleep(0.05)


def request_span(setup: Setup, trace_id: str):
    spans = setup.receiver.wait_for_trace(trace_id)
    (span,) = [s for s in spans if s.kind == "server"]
    return span, spans


@dataclass
class Outputs:
    line: dict
    row: dict | None
    span: object
    spans: list
    metrics: dict  # moved samples


def observe(setup: Setup, request_id: str, before: dict, *, row: bool = True) -> Outputs:
    line = access_line(setup.gateway, request_id)
    found = ledger_rows(setup, request_id, 1 if row else 0)
    span, spans = request_span(setup, line["trace_id"])
    time.sleep(0.2)  # metrics are recorded as the request ends, with its line; let any late one land
    after = scrape(setup.gateway)
    metrics = changed(before, after, "portico_requests_total", "portico_input_tokens_total",
                      "portico_output_tokens_total", "portico_spend_microdollars_total",
                      "portico_request_duration_seconds_count", "portico_upstream_retries_total",
                      "portico_upstream_fallbacks_total", "portico_cache_lookups_total",
                      "portico_rate_limit_rejections_total", "portico_time_to_first_token_seconds_count",
                      "portico_deployment_requests_total", "portico_upstream_duration_seconds_count",
                      "portico_upstream_duration_seconds_sum", "portico_request_duration_seconds_sum",
                      "portico_time_to_first_token_seconds_sum")
    return Outputs(line, found[0] if found else None, span, spans, metrics)


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


def agree(out: Outputs, *, request_id: str, key_id: str | None, model: str, status: int, code: str | None,
          endpoint: str = CHAT) -> None:
    """Every output names this request alike, and the metrics count it once, with the ledger's tokens and cost."""
    line, row, span = out.line, out.row, out.span
    assert (line["key_id"], line["model"], line["status"], line["code"]) == (key_id, model or None, status, code), line
    attrs = span.attributes
    assert attrs.get("portico.request_id") == request_id, attrs
    assert attrs.get("portico.key_id") == key_id, attrs
    assert attrs.get("http.response.status_code") == status, attrs
    assert attrs.get("portico.error.code") == code, attrs
    assert attrs.get("gen_ai.request.model") == (model or None), attrs
    # operations.md, Traces: ERROR for a 5xx or a stream failed after its 200; a 4xx keeps an unset status
    assert span.error == (status >= 500 or bool(code and status < 400)), (span.error, attrs)
    assert attrs.get("error.type") is None if code is None else attrs.get("error.type"), attrs
    assert attrs.get("portico.upstream_attempts", 0) == line["upstream_attempts"], (attrs, line)
    series = labels(endpoint=endpoint, model=model, status=str(status), code=code or "")
    requests = {k: v for k, v in out.metrics.items() if k[0] == "portico_requests_total"}
    assert requests == {("portico_requests_total", series): 1.0}, out.metrics
    durations = {k: v for k, v in out.metrics.items() if k[0] == "portico_request_duration_seconds_count"}
    assert durations == {("portico_request_duration_seconds_count", labels(endpoint=endpoint, model=model)): 1.0}, \
        out.metrics
    def moved(name: str) -> float:
        return sum(v for k, v in out.metrics.items() if k[0] == name)

    assert abs(moved("portico_request_duration_seconds_sum") * 1000 - line["duration_ms"]) < 1, (line, out.metrics)
    assert moved("portico_upstream_duration_seconds_count") == (line["upstream_ms"] is not None), (line, out.metrics)
    if line["upstream_ms"] is not None:
        assert abs(moved("portico_upstream_duration_seconds_sum") * 1000 - line["upstream_ms"]) < 1, \
            (line, out.metrics)
    assert moved("portico_time_to_first_token_seconds_count") == (line["first_token_ms"] is not None), \
        (line, out.metrics)
    if line["first_token_ms"] is not None:
        assert abs(moved("portico_time_to_first_token_seconds_sum") * 1000 - line["first_token_ms"]) < 1, \
            (line, out.metrics)
    for name, series in out.metrics:  # a fallback's tokens and spend are the model asked for's, the caller's key's
        if name in ("portico_input_tokens_total", "portico_output_tokens_total", "portico_spend_microdollars_total"):
            assert dict(series) == {"model": model, "key_id": key_id}, out.metrics
    tokens_in = sum(v for k, v in out.metrics.items() if k[0] == "portico_input_tokens_total")
    tokens_out = sum(v for k, v in out.metrics.items() if k[0] == "portico_output_tokens_total")
    spend = sum(v for k, v in out.metrics.items() if k[0] == "portico_spend_microdollars_total")
    assert (line["input_tokens"], line["output_tokens"]) == (tokens_in, tokens_out), (line, out.metrics)
    if attrs.get("gen_ai.usage.input_tokens") is not None or tokens_in:
        assert (attrs.get("gen_ai.usage.input_tokens"), attrs.get("gen_ai.usage.output_tokens")) == \
            (tokens_in, tokens_out), (attrs, out.metrics)
    attempts = [s for s in out.spans if s.kind == "client" or s.name.startswith("generate ")]
    assert len(attempts) == line["upstream_attempts"], (line, [(s.name, s.attributes) for s in attempts])
    deployments = {k: v for k, v in out.metrics.items() if k[0] == "portico_deployment_requests_total"}
    assert sum(deployments.values()) == line["upstream_attempts"], (line, deployments)
    for attempt in [s for s in attempts if s.kind == "client"]:  # a generation span names no deployment
        named = ("portico_deployment_requests_total",
                 labels(model=attempt.attributes["portico.model"],
                        deployment=attempt.attributes.get("portico.deployment", "?")))
        assert named in deployments, (attempt.attributes, deployments)
    if row is None:
        assert (tokens_in, tokens_out, spend) == (0, 0, 0), out.metrics
        return
    assert row["project_id"] == line["key_env"], (row, line)
    if attempts and status == 200 and attempts[-1].kind == "client":
        assert row["deployment"] == attempts[-1].attributes.get("portico.deployment"), \
            (row, attempts[-1].attributes)
    assert (row["request_id"], row["api_key_id"], row["model"], row["status"], row["code"], row["endpoint"]) == \
        (request_id, key_id, model, status, code, endpoint), row
    assert (row["input_tokens"], row["output_tokens"], row["cost_microdollars"]) == (tokens_in, tokens_out, spend), \
        (row, out.metrics)
    if status == 200:
        assert row["upstream"] == attrs.get("gen_ai.response.model"), (row, attrs)
    assert (row["first_token_ms"] is None) == (line["first_token_ms"] is None), (row, line)


def openai_caller(setup: Setup, request_id: str, secret: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{setup.gateway.base_url}/v1", api_key=secret or setup.secret, max_retries=0,
                         default_headers={"x-request-id": request_id})


def rid(kind: str) -> str:
    return f"agree-{kind}-{secrets.token_hex(4)}"


def limited_key(setup: Setup, *options: str) -> tuple[str, str]:
    out = setup.gateway.cli("keys", "create", "--name", "agree-limited", "--models", "priced,solo", *options).stdout
    return out.split()[2], out.strip().splitlines()[-1]


def ttft_moved(out: Outputs) -> float:
    return sum(v for k, v in out.metrics.items() if k[0] == "portico_time_to_first_token_seconds_count")


def totals_agree(setup: Setup) -> None:
    """Run last in a module: every request of the module's key, summed by the ledger's rows, the usage and costs API
    and the metrics."""
    time.sleep(1)
    headers = {"authorization": f"Bearer {setup.secret}"}
    base = setup.gateway.base_url
    rows = httpx.get(f"{base}/v1/organization/requests", params={"start_time": 0, "limit": 1000},
                     headers=headers, timeout=30).json()["data"]
    usage = httpx.get(f"{base}/v1/organization/usage/completions", headers=headers, timeout=30,
                      params={"start_time": 0, "bucket_width": "all", "group_by": "model"}).json()
    costs = httpx.get(f"{base}/v1/organization/costs", headers=headers, timeout=30,
                      params={"start_time": 0, "bucket_width": "all", "group_by": "model"}).json()
    samples = scrape(setup.gateway)
    by_key = lambda name: {dict(k[1])["model"]: v for k, v in samples.items()  # noqa: E731
                           if k[0] == name and dict(k[1]).get("key_id") == setup.key_id}
    models = {row["model"] for row in rows}
    text_rows = [row for row in rows if row["endpoint"] in (CHAT, "/v1/messages")]
    results = {r["model"]: r for r in usage["data"][0]["results"]}
    money = {r["model"]: r["amount_microdollars"] for r in costs["data"][0]["results"]}
    for model in models:
        mine = [row for row in rows if row["model"] == model]
        tokens_in, tokens_out = sum(r["input_tokens"] for r in mine), sum(r["output_tokens"] for r in mine)
        cost = sum(r["cost_microdollars"] for r in mine)
        assert by_key("portico_input_tokens_total").get(model, 0) == tokens_in, model
        assert by_key("portico_output_tokens_total").get(model, 0) == tokens_out, model
        assert by_key("portico_spend_microdollars_total").get(model, 0) == cost, model
        assert money.get(model, 0) == cost, model
        text = [row for row in text_rows if row["model"] == model]
        if text:
            result = results[model]
            assert (result["input_tokens"], result["output_tokens"], result["num_requests"]) == \
                (tokens_in, tokens_out, len(text)), (model, result)
            reached = [r for r in text if r["upstream"] is not None]
            assert result["num_model_requests"] == len(reached), (model, result, [
                (r["status"], r["code"], r["upstream"]) for r in text])
            errors = [r for r in text if r["status"] >= 400 or r["code"]]
            assert result["num_errors"] == len(errors), (model, result, [(r["status"], r["code"]) for r in text])
