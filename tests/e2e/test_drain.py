"""Stopped while 50 streams are open, by SIGTERM or by a terminal's Ctrl-C (SIGINT to the whole process group,
Envoy included): no new connections are accepted, every open stream runs to its end, then the gateway exits 0.
The embedded model serves one sequence at a time, so the streams are short (4 tokens)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import yaml

from gateway.envoy import repo_root
from tests.e2e.conftest import running_gateway
from tests.upstream_double import Cue
from tests.upstream_support import write_config
from tests.e2e.test_operations import scrape, value

STREAMS = 50
CHAT = "/v1/chat/completions"


async def one_stream(client: httpx.AsyncClient, secret: str) -> tuple[int, list[str]]:
    body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True}
    async with client.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {secret}"}) as response:
        return response.status_code, [line async for line in response.aiter_lines() if line]


def sigterm(process) -> None:
    process.send_signal(signal.SIGTERM)


def ctrl_c(process) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: the foreground group, children included


@pytest.mark.parametrize("stop", [sigterm, ctrl_c])
def test_stopping_lets_50_open_streams_finish(tmp_path, stop):
    raw = yaml.safe_load((repo_root() / "server" / "default.yaml").read_text())
    raw["drain_seconds"] = 120  # room for a busy machine; on an idle one the streams need about 3 s
    config = tmp_path / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    with running_gateway(tmp_path / "drain-data", config=config) as gateway:
        secret = gateway.cli("keys", "create", "--name", "drain", "--all-models", "--concurrency", "100",
                             "--rpm", "1000").stdout.split()[-1]

        async def scenario() -> list[tuple[int, list[str]]]:
            limits = httpx.Limits(max_connections=STREAMS + 10)
            async with httpx.AsyncClient(base_url=gateway.base_url, limits=limits, timeout=60) as client:
                streams = [asyncio.create_task(one_stream(client, secret)) for _ in range(STREAMS)]
                deadline = time.monotonic() + 30
                while value(await asyncio.to_thread(scrape, gateway), "portico_requests_in_flight",
                            endpoint=CHAT) < STREAMS:  # every stream has reached the server
                    assert time.monotonic() < deadline and not any(s.done() for s in streams)
                    await asyncio.sleep(0.02)
                stop(gateway.process)
                with pytest.raises(httpx.ConnectError):  # no new connections, while the streams go on
                    for _ in range(100):
                        async with httpx.AsyncClient(base_url=gateway.base_url) as late:
                            await late.get("/healthz")
                        await asyncio.sleep(0.02)
                return await asyncio.gather(*streams)

        results = asyncio.run(scenario())
        assert gateway.process.wait(timeout=60) == 0
    assert [status for status, _ in results] == [200] * STREAMS
    for _, lines in results:
        assert lines[-1] == "data: [DONE]" and any('"content"' in line for line in lines)
    log = gateway.log_path.read_text()
    assert "stopping: no new connections" in log
    assert sum('"status":200' in line and '"rpc":"ChatService/CreateChatCompletionHttp"' in line
               for line in log.splitlines()) == STREAMS


def test_a_second_ctrl_c_cuts_the_drain_short(tmp_path, double):
    """Ctrl-C pressed again during the drain: the requests still in flight are cut and the gateway stops at once,
    instead of waiting up to drain_seconds for them."""
    double.cue(Cue(frame_delay=0.25))  # one word every 0.25 s: 60 words take 15 s
    models = f"  - {{id: slow-echo, endpoint: {CHAT}, provider: {{kind: openai, base_url: '{double.url}', model: m}}}}\n"
    config = write_config(tmp_path, models)
    config.write_text(config.read_text() + "drain_seconds: 120\n")
    body = {"model": "slow-echo", "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}],
            "max_tokens": 100, "stream": True}
    with running_gateway(tmp_path / "data", config=config) as gateway:
        lines: list[str] = []
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            with client.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {gateway.secret}"}) as answer:
                try:
                    for line in answer.iter_lines():
                        lines.append(line)
                        if len(lines) == 1:  # the stream is under way
                            ctrl_c(gateway.process)
                            time.sleep(0.3)
                            ctrl_c(gateway.process)
                except httpx.HTTPError:
                    pass  # a cut stream may also end as a broken response
        assert gateway.process.wait(timeout=10) == 0  # the stream alone would have needed 15 s
    assert lines and "data: [DONE]" not in lines  # cut, not finished
    log = gateway.log_path.read_text()
    assert "second stop signal: ending the requests in flight now" in log
