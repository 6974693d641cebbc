"""`portico serve --workers 2` with the Redis limit store: one limit held exactly across two server processes, load
on both, metrics summed over both (and kept across a restart), a killed worker restarted while the other keeps
serving, and N > 1 refused without a shared store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from gateway.envoy import free_ports, repo_root
from tests.e2e.conftest import Gateway, running_gateway
from tests.e2e.test_operations import documented_families, scrape, value

HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
HANG_SECONDS = 8  # worker_hang_seconds: a worker whose health service is silent this long is killed


@pytest.fixture(scope="module")
def workers(tmp_path_factory, redis_server) -> Gateway:
    raw = yaml.safe_load((repo_root() / "server" / "default.yaml").read_text())
    raw["limits"]["store"] = redis_server.url
    raw["worker_hang_seconds"] = HANG_SECONDS
    config = tmp_path_factory.mktemp("workers-config") / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    with running_gateway(tmp_path_factory.mktemp("workers-data"), "--workers", "2", config=config) as gateway:
        yield gateway


def requests_per_worker(gateway: Gateway) -> list[int]:
    """Requests Envoy sent each worker so far, in the order of their index."""
    clusters = httpx.get(f"http://127.0.0.1:{gateway.admin_port}/clusters", timeout=60).text
    found = re.findall(r"^portico_grpc::.*grpc-(\d)\.sock::rq_total::(\d+)$", clusters, re.M)
    return [int(n) for _, n in sorted(found)]


def health_of(gateway: Gateway, index: int) -> str:
    """Envoy's health flags of a worker's endpoint."""
    clusters = httpx.get(f"http://127.0.0.1:{gateway.admin_port}/clusters", timeout=60).text
    return re.search(rf"^portico_grpc::.*grpc-{index}\.sock::health_flags::(.*)$", clusters, re.M).group(1)


def wait_until_both_serve(gateway: Gateway) -> None:
    """Until Envoy's health checks found both workers serving (a restarted one is out until its first check)."""
    deadline = time.monotonic() + 20
    while any(health_of(gateway, index) != "healthy" for index in (0, 1)):
        assert time.monotonic() < deadline, [health_of(gateway, index) for index in (0, 1)]
        time.sleep(0.1)


def worker_pids(gateway: Gateway, index: int) -> list[int]:
    return [int(p) for p in re.findall(rf"worker {index} \(pid (\d+)\) serving", gateway.log_path.read_text())]


def test_one_limit_holds_exactly_across_two_workers(workers):
    secret = workers.cli("keys", "create", "--name", "burst", "--all-models", "--rpm", "50",
                         "--concurrency", "1000").stdout.split()[-1]

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=workers.base_url, limits=limits, timeout=60) as client:
            headers = {"Authorization": f"Bearer {secret}"}
            calls = [client.post("/v1/chat/completions", json=HI, headers=headers) for _ in range(200)]
            return [r.status_code for r in await asyncio.gather(*calls)]

    before = requests_per_worker(workers)
    statuses = asyncio.run(burst())
    assert (statuses.count(200), statuses.count(429)) == (50, 150)
    served = [after - b for after, b in zip(requests_per_worker(workers), before)]
    assert len(served) == 2 and all(n > 20 for n in served), served  # Envoy spread them over both


def test_metrics_are_summed_over_the_workers_and_survive_a_restart(workers):
    out = workers.cli("keys", "create", "--name", "counted", "--all-models").stdout
    key_id, secret = out.split()[2], out.split()[-1]
    before = requests_per_worker(workers)
    with httpx.Client(base_url=workers.base_url, headers={"Authorization": f"Bearer {secret}"},
                      timeout=60) as client:
        for _ in range(12):
            assert client.post("/v1/chat/completions", json=HI).status_code == 200
    assert all(after > b for after, b in zip(requests_per_worker(workers), before))  # both served some
    tokens = dict(model="family-a-5.5", key_id=key_id)
    assert value(scrape(workers), "portico_output_tokens_total", **tokens) == 12

    (pid,) = worker_pids(workers, 1)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while len(worker_pids(workers, 1)) < 2:
        assert time.monotonic() < deadline, workers.log_path.read_text()[-2000:]
        time.sleep(0.2)
    samples = scrape(workers)
    assert value(samples, "portico_output_tokens_total", **tokens) == 12  # the dead worker's share is kept
    assert value(samples, "portico_requests_in_flight", endpoint="/v1/chat/completions") == 0


def test_the_summed_scrape_holds_only_documented_metrics_without_created_series(workers):
    families = documented_families(workers, workers=True)
    assert families["portico_requests_in_flight"].samples  # the live workers' gauge, summed


def test_a_killed_worker_is_restarted_while_the_other_serves(workers):
    wait_until_both_serve(workers)
    (first,) = worker_pids(workers, 0)
    os.kill(first, signal.SIGKILL)
    # Once the death is noticed (a request sent on the dead worker's connection in the instant before that can
    # fail, which is why Envoy does not retry requests that were already sent), Envoy retries the refused
    # connections on the other worker: no request fails while the worker restarts.
    wait_for_log(workers, "worker 0 (pid %d) exited" % first)
    headers = {"Authorization": f"Bearer {workers.secret}"}
    for _ in range(10):
        response = httpx.post(f"{workers.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 60
    while len(worker_pids(workers, 0)) < 2:
        assert time.monotonic() < deadline, workers.log_path.read_text()[-2000:]
        time.sleep(0.2)
    assert worker_pids(workers, 0)[-1] != first


def test_a_frozen_worker_leaves_the_rotation_and_is_restarted(workers):
    """A worker that stops answering but keeps its socket (stopped, or its event loop stuck) still took its share of
    new requests, which hung until Envoy's 300 s silence limit. Envoy's health checks now take it out within
    seconds; the requests it already held hung all the same, until the supervisor now kills it once it has been
    silent for worker_hang_seconds: they end (503, which the SDKs retry), and its restart rejoins the rotation."""
    wait_until_both_serve(workers)
    (pid,) = worker_pids(workers, 1)[-1:]
    started_before = len(worker_pids(workers, 1))
    headers = {"Authorization": f"Bearer {workers.secret}"}

    async def at_once(count: int) -> list[int]:
        async with httpx.AsyncClient(base_url=workers.base_url, headers=headers, timeout=40) as client:
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=HI) for _ in range(count)))
            return [answer.status_code for answer in answers]

    before = requests_per_worker(workers)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        statuses = asyncio.run(at_once(8))  # sent before Envoy's checks notice: some reach the frozen worker
        took = time.monotonic() - started
        assert requests_per_worker(workers)[1] > before[1]
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
        assert took < 2 * HANG_SECONDS + 10, took  # silent for 8 s, found so by a check that waits its timeout
        wait_for_log(workers, f"worker 1 (pid {pid}) has not answered its health checks for")
        before = requests_per_worker(workers)
        for _ in range(8):  # until it is back, the other worker serves every new request
            response = httpx.post(f"{workers.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=10)
            assert response.status_code == 200, response.text
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by the supervisor, as it should be
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while len(worker_pids(workers, 1)) == started_before:
        assert time.monotonic() < deadline, workers.log_path.read_text()[-2000:]
        time.sleep(0.2)
    wait_until_both_serve(workers)
    after = requests_per_worker(workers)
    assert after[0] >= before[0] + 8 and after[1] == before[1], (before, after)
    deadline = time.monotonic() + 20
    while requests_per_worker(workers)[1] == after[1]:  # back in the rotation
        assert time.monotonic() < deadline, "the worker was not sent requests again"
        httpx.post(f"{workers.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=10)


@pytest.mark.parametrize("edit", ["a new model id", "a typo"])
def test_a_restarted_worker_serves_the_configuration_serve_started_with(tmp_path, redis_server, edit):
    """The file is edited for the next restart while the gateway runs. A worker restarted after a crash read it
    again: with a new model id the two workers served two catalogs (callers saw the model come and go), and with a
    typo the worker could not start and the whole gateway stopped."""
    config = tmp_path / "portico.yaml"
    started = (f"limits: {{store: '{redis_server.url}'}}\naccess_log: off\nmodels:\n"
               "  - {id: img, endpoint: /v1/images/generations, provider: {kind: dev-image}}\n")
    config.write_text(started)
    with running_gateway(tmp_path / "data", "--workers", "2", config=config) as gateway:
        config.write_text(started.replace("id: img", "id: img-next") + ("default_max_token: 5\n" if edit == "a typo"
                                                                        else ""))
        (first,) = worker_pids(gateway, 0)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(worker_pids(gateway, 0)) < 2:
            assert gateway.process.poll() is None, gateway.log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, gateway.log_path.read_text()[-2000:]
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {gateway.secret}"}
        catalogs = {str([m["id"] for m in httpx.get(f"{gateway.base_url}/v1/models", headers=headers,
                                                    timeout=30).json()["data"]]) for _ in range(20)}
        assert catalogs == {"['img']"}


def wait_for_log(gateway: Gateway, text: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while text not in gateway.log_path.read_text():
        assert time.monotonic() < deadline, gateway.log_path.read_text()[-2000:]
        time.sleep(0.05)


def test_several_workers_need_a_shared_store(tmp_path):
    port, admin_port = free_ports(2)
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--data-dir", str(tmp_path), "serve", "--workers", "2",
         "--port", str(port), "--admin-port", str(admin_port)],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert "--workers 2 needs a shared rate-limit store" in result.stderr and "redis://" in result.stderr
