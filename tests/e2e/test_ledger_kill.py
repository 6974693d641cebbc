"""Rows of answered requests outlive a process killed before its writer's next batch (`kill -9`, out of memory):
the usage ledger is written in batches, at most every `usage.flush_seconds`, and what a killed process had not
written yet is written by the next process to start on the data dir: the worker the supervisor starts in its
place, or `portico serve` started again. A request still running when its process was killed gets its row that
way too: the 503 its caller got, with nothing used (what it used died with the process)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server.db import StoreSettings
from server.usage.stores import open_ledger
from tests.e2e.conftest import Gateway, running_gateway
from tests.e2e.test_workers import wait_for_log, worker_pids
from tests.redis_support import start_redis
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Say hello."}]
SLOW_FLUSH = 600  # seconds: no batch is written while the test runs, so every answered row waits in memory


def config(directory: Path, double_url: str, **top) -> Path:
    raw = {
        "usage": {"flush_seconds": SLOW_FLUSH},
        "models": [{"id": "up", "endpoint": "/v1/chat/completions",
                    "provider": {"kind": "openai", "base_url": double_url, "api_key_env": UPSTREAM_KEY_ENV,
                                 "model": "up-model"}, "price": {"input": 3, "output": 7}}],
        **top,
    }
    path = directory / "portico.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def answered(gateway: Gateway, secret: str, count: int) -> list[str]:
    """`count` chat requests, each answered 200; their request ids."""
    ids = []
    for n in range(count):
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"model": "up", "messages": HELLO},
                              headers={"Authorization": f"Bearer {secret}", "x-request-id": f"kill-{n}"}, timeout=30)
        assert response.status_code == 200, response.text
        ids.append(response.headers["x-request-id"])
    return ids


def rows_of(data_dir: Path, key_id: str, want: int, within: float = 30.0) -> list:
    ledger = open_ledger(StoreSettings(sqlite_path=data_dir / "keys.db"))
    try:
        deadline = time.monotonic() + within
        while True:
            rows = [row for row in ledger.rows() if row.key_id == key_id]
            if len(rows) >= want or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)
    finally:
        ledger.close()


def created(gateway: Gateway, *options: str) -> tuple[str, str]:
    """A key made with `portico keys create --name k --all-models OPTIONS`: its id and secret."""
    out = gateway.cli("keys", "create", "--name", "k", "--all-models", *options).stdout
    return out.split()[2], out.split()[-1]


def admin_of(gateway: Gateway) -> dict[str, str]:
    secret = gateway.cli("keys", "create", "--name", "admin", "--admin", "--all-models").stdout.splitlines()[-1]
    return {"authorization": f"Bearer {secret}"}


def upstream_holds(gateway: Gateway, double, secret: str, answer_expected: bool = True,
                   **body) -> tuple[threading.Thread, list[int]]:
    """A chat request the upstream holds for a minute, sent from a thread once the upstream has it: the thread, and
    the status its caller gets (once the thread ends). `answer_expected` False: a connection closed with no answer
    is what its caller gets (no status)."""
    double.cue(Cue(delay=60))
    seen = len(double.seen)
    statuses: list[int] = []

    def call() -> None:
        try:
            statuses.append(httpx.post(
                f"{gateway.base_url}/v1/chat/completions", json={"model": "up", "messages": HELLO, **body},
                headers={"Authorization": f"Bearer {secret}", "x-request-id": "kill-running"}, timeout=30,
            ).status_code)
        except httpx.TransportError:
            if answer_expected:
                raise

    caller = threading.Thread(target=call)
    caller.start()
    while len(double.seen) == seen:
        time.sleep(0.01)
    return caller, statuses


def killed_while_it_holds(gateway: Gateway, double, secret: str, *, after: float = 0.0) -> None:
    """`portico serve` killed (kill -9) `after` seconds into a request (max_tokens 50000) its upstream holds. Its
    caller's connection is closed with no answer (one process: Envoy goes with it)."""
    caller, _ = upstream_holds(gateway, double, secret, max_tokens=50000, answer_expected=False)
    time.sleep(after)
    gateway.process.send_signal(signal.SIGKILL)
    gateway.process.wait(10)
    caller.join()


def kill_workers(gateway: Gateway) -> None:
    """`kill -9` of both workers' latest processes, then wait for the supervisor to have seen each exit."""
    victims = worker_pids(gateway, 0)[-1:] + worker_pids(gateway, 1)[-1:]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    for index, pid in enumerate(victims):
        wait_for_log(gateway, f"worker {index} (pid {pid}) exited")


def used_once_slots_are_free(gateway: Gateway, key_id: str, admin: dict[str, str], within: float = 10.0) -> dict:
    """The key's limits standing (`used` by limit), read until no concurrency slot is taken or `within` passed. Both
    workers were just killed: until Envoy sees one serve again, a request may get 503, as the SDKs' retries would."""
    deadline = time.monotonic() + within
    while True:
        answer = httpx.get(f"{gateway.base_url}/v1/admin/keys/{key_id}/limits", headers=admin)
        if answer.status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
            continue
        assert answer.status_code == 200, answer.text
        used = {limit["limit"]: limit["used"] for limit in answer.json()["limits"]}
        if used.get("concurrent_requests") == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def test_a_killed_worker_s_answered_rows_are_written_by_the_worker_that_replaces_it(tmp_path, double,
                                                                                    redis_server):
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        path = config(tmp_path, double.url, limits={"store": redis_server.url})
        with running_gateway(tmp_path / "data", "--workers", "2", config=path) as gateway:
            key_id, secret = created(gateway)
            ids = answered(gateway, secret, 8)  # Envoy spreads them over both workers
            caller, late = upstream_holds(gateway, double, secret)  # still running when its worker dies
            kill_workers(gateway)
            caller.join()
            assert late == [503]
            rows = {row.request_id: row for row in rows_of(gateway.data_dir, key_id, len(ids) + 1)}
            assert sorted(rows) == sorted([*ids, "kill-running"])
            assert all(rows[i].status == 200 and rows[i].cost_micros > 0 for i in ids)
            running = rows["kill-running"]
            assert (running.status, running.code, running.upstream, running.upstream_attempts) == (
                503, "service_unavailable", "up", 1)
            assert (running.input_tokens, running.output_tokens, running.cost_micros) == (0, 0, 0)
            # Written once each, and nothing left to write again.
            time.sleep(0.5)
            assert len(rows_of(gateway.data_dir, key_id, 0, within=0)) == len(ids) + 1
            assert not [p for p in (gateway.data_dir / "ledger-spool").iterdir() if p.stat().st_size]
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def test_a_killed_worker_s_reservations_are_settled_by_the_worker_that_replaces_it(tmp_path, double,
                                                                                  redis_server):
    """Its request's row says one request, nothing used, and a Redis store's counters must say the same: they kept
    the reservation's estimates (prompt + max tokens, the most it could cost) for the rest of the day and month, and
    its concurrency slot until its lease ran out."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        path = config(tmp_path, double.url, limits={"store": redis_server.url, "lease_seconds": 600})
        with running_gateway(tmp_path / "data", "--workers", "2", config=path) as gateway:
            key_id, secret = created(gateway, "--daily-tokens", "10000000", "--daily-requests", "1000",
                                     "--concurrency", "50", "--max-spend-day", "1000")
            ids = answered(gateway, secret, 2)
            caller, late = upstream_holds(gateway, double, secret, max_tokens=50000)  # running at the kill
            kill_workers(gateway)
            caller.join()
            assert late == [503]
            rows = rows_of(gateway.data_dir, key_id, len(ids) + 1)
            used = used_once_slots_are_free(gateway, key_id, admin_of(gateway))
            assert used["concurrent_requests"] == 0  # its slot, long before its 600 s lease ends
            assert used["daily_requests"] == 3  # as the rows count them: the killed one reached its model
            assert used["daily_tokens"] == sum(row.input_tokens + row.output_tokens for row in rows)
            assert float(used["max_spend_day"]) == pytest.approx(sum(row.cost_micros for row in rows) / 1e6)
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def test_rows_of_a_killed_serve_are_written_when_serve_starts_again(tmp_path, double):
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        path = config(tmp_path, double.url)
        with running_gateway(tmp_path / "data", config=path) as gateway:
            key_id, secret = created(gateway)
            ids = answered(gateway, secret, 3)
            gateway.process.send_signal(signal.SIGKILL)
            gateway.process.wait(10)
        assert rows_of(tmp_path / "data", key_id, 0, within=0) == []  # nothing was written before the kill
        with running_gateway(tmp_path / "data", config=path, dev_key=False):
            rows = rows_of(tmp_path / "data", key_id, len(ids))
        assert sorted(row.request_id for row in rows) == sorted(ids)
        mode = (tmp_path / "data" / "ledger-spool").stat().st_mode & 0o777
        assert mode == 0o700, oct(mode)
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def test_rows_are_still_written_after_the_spool_directory_was_deleted(tmp_path, double):
    """An operator clearing `ledger-spool/` by hand (it looks like a cache) must not stop the ledger: the writer
    failed to start its next segment there and died, and no row was written again until a restart."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        path = config(tmp_path, double.url, usage={"flush_seconds": 0.1})
        with running_gateway(tmp_path / "data", config=path) as gateway:
            key_id, secret = created(gateway)
            first = answered(gateway, secret, 1)
            assert len(rows_of(gateway.data_dir, key_id, 1)) == 1
            shutil.rmtree(gateway.data_dir / "ledger-spool")
            later = [f"later-{n}" for n in range(3)]
            for request_id in later:
                response = httpx.post(f"{gateway.base_url}/v1/chat/completions",
                                      json={"model": "up", "messages": HELLO}, timeout=30,
                                      headers={"Authorization": f"Bearer {secret}", "x-request-id": request_id})
                assert response.status_code == 200
                time.sleep(0.2)  # a write pass each
            rows = rows_of(gateway.data_dir, key_id, 4, within=5)
            assert sorted(row.request_id for row in rows) == sorted([*first, *later])
            mode = (gateway.data_dir / "ledger-spool").stat().st_mode & 0o777
            assert mode == 0o700, oct(mode)
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def test_an_upgrade_settles_the_reservations_of_a_27_november_version_killed_with_requests_running(
        tmp_path, double, redis_server):
    """Versions from d3188ee until 7fb2452 (f9a2dbf among them) wrote what a reservation booked as its mark's ninth
    value. Upgraded from one killed, the new version wrote the 503 row but settled nothing: the key's only concurrency
    slot stayed taken for its 600 s lease (429 meanwhile) and max_tokens 50000 stayed in its daily tokens."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    data = tmp_path / "data"
    try:
        path = config(tmp_path, double.url, limits={"store": redis_server.url, "lease_seconds": 600})
        with running_gateway(data, config=path) as gateway:
            key_id, secret = created(gateway, "--daily-tokens", "10000000", "--concurrency", "1")
            admin = admin_of(gateway)
            killed_while_it_holds(gateway, double, secret)
        for segment in (data / "ledger-spool").iterdir():  # as the old version wrote its marks
            lines = [json.loads(line) for line in segment.read_text().splitlines() if line]
            segment.write_text("".join(json.dumps({"open": [*line["open"], line.get("booked")]} if "open" in line
                                                  else line) + "\n" for line in lines))
        with running_gateway(data, config=path, dev_key=False) as gateway:
            used = used_once_slots_are_free(gateway, key_id, admin)
            assert used["concurrent_requests"] == 0
            assert used["daily_tokens"] == 0
            assert [(row.status, row.input_tokens) for row in rows_of(data, key_id, 1)] == [(503, 0)]
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def test_reservations_left_unsettled_by_a_drain_while_redis_did_not_answer_are_settled_at_the_next_start(
        tmp_path, double):
    """The process adopting a killed one's spool wrote its rows and deleted the spool at once, while the settling of
    its reservations was still being retried (Redis not answering). Stopped meanwhile (a drain, or killed too), it
    gave up, and nothing was left for the next process to settle: the estimates (max_tokens 50000, the slot for its
    600 s lease) stayed counted though Redis answered again."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    (tmp_path / "redis-files").mkdir()
    redis = start_redis(tmp_path / "redis-files")
    data = tmp_path / "data"
    try:
        path = config(tmp_path, double.url, limits={"store": redis.url, "lease_seconds": 600,
                                                    "store_timeout_seconds": 0.2})
        with running_gateway(data, config=path) as gateway:
            key_id, secret = created(gateway, "--daily-tokens", "10000000", "--concurrency", "50")
            admin = admin_of(gateway)
            killed_while_it_holds(gateway, double, secret)
        os.kill(redis.process.pid, signal.SIGSTOP)  # Redis does not answer while the next process starts
        try:
            with running_gateway(data, config=path, dev_key=False) as gateway:
                wait_for_log(gateway, "could not settle a rate-limit reservation")
                assert len(rows_of(data, key_id, 1)) == 1
        finally:
            os.kill(redis.process.pid, signal.SIGCONT)
        assert "left in the ledger's spool for the next process" in (tmp_path / "data.log").read_text()
        with running_gateway(data, config=path, dev_key=False) as gateway:
            used = used_once_slots_are_free(gateway, key_id, admin)
            assert used["concurrent_requests"] == 0
            assert used["daily_tokens"] == 0
            assert len(rows_of(data, key_id, 1)) == 1  # its row, written once
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        redis.stop()


def test_a_killed_serve_s_running_request_counts_as_its_row_says_with_the_in_process_store(tmp_path, double):
    """The in-process store saves the day's and month's counters every 2 s: a request running then was saved with
    its estimates (max_tokens 50000, the most it could cost), so after `kill -9` and a start the key's daily tokens
    and spend kept them for the rest of the day, where its ledger row says one request with nothing used."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    data = tmp_path / "data"
    try:
        path = config(tmp_path, double.url)
        with running_gateway(data, config=path) as gateway:
            key_id, secret = created(gateway, "--daily-tokens", "10000000", "--max-spend-day", "1000")
            admin = admin_of(gateway)
            answered(gateway, secret, 1)
            killed_while_it_holds(gateway, double, secret, after=2.5)  # a save of the day's counters meanwhile
        with running_gateway(data, config=path, dev_key=False) as gateway:
            rows = rows_of(data, key_id, 2)
            used = used_once_slots_are_free(gateway, key_id, admin, within=0)
            assert len(rows) == 2
            assert used["daily_tokens"] == sum(row.input_tokens + row.output_tokens for row in rows)
            assert float(used["max_spend_day"]) == pytest.approx(sum(row.cost_micros for row in rows) / 1e6)
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)
