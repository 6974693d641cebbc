"""Stopped while 50 streams are open, by SIGTERM or by a terminal's Ctrl-C (SIGINT to the whole process group,
Envoy included): no new connections are accepted, every open stream runs to its end, then the gateway exits 0.
The embedded model serves one sequence at a time, so the streams are short (4 tokens)."""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import h2.connection
import httpx
import openai
import orjson
import pytest
import yaml

from gateway.envoy import free_ports, repo_root
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
            # The last of the queue waits for 49 answers before its first byte: as long as the drain may last.
            async with httpx.AsyncClient(base_url=gateway.base_url, limits=limits, timeout=120) as client:
                streams = [asyncio.create_task(one_stream(client, secret)) for _ in range(STREAMS)]
                deadline = time.monotonic() + 30
                while value(await asyncio.to_thread(scrape, gateway), "portico_requests_in_flight",
                            endpoint=CHAT) < STREAMS:  # every stream has reached the server
                    assert time.monotonic() < deadline and not any(s.done() for s in streams)
                    await asyncio.sleep(0.02)
                stop(gateway.process)
                with pytest.raises(httpx.ConnectError):  # no new connections, while the streams go on
                    for _ in range(100):
                        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as late:
                            await late.get("/healthz")
                        await asyncio.sleep(0.02)
                # Only the public port closes: an operator still reads Envoy's stats while the streams finish.
                async with httpx.AsyncClient() as operator:
                    stats = await operator.get(f"http://127.0.0.1:{gateway.admin_port}/stats?filter=rq_active",
                                               timeout=30)
                assert stats.status_code == 200 and not all(s.done() for s in streams)
                return await asyncio.gather(*streams)

        results = asyncio.run(scenario())
        assert gateway.process.wait(timeout=120) == 0
    assert [status for status, _ in results] == [200] * STREAMS
    for _, lines in results:
        assert lines[-1] == "data: [DONE]" and any('"content"' in line for line in lines)
    log = gateway.log_path.read_text()
    assert "stopping: no new connections" in log
    assert sum('"status":200' in line and '"rpc":"ChatService/CreateChatCompletionHttp"' in line
               for line in log.splitlines()) == STREAMS


def slow_echo(tmp_path, double, *, words: int, seconds_a_word: float):
    """A gateway's config (drain_seconds 120) whose model slow-echo streams back the prompt one word at a time from
    `double`, and the streamed request of `words` words for it."""
    double.cue(Cue(frame_delay=seconds_a_word))
    models = f"  - {{id: slow-echo, endpoint: {CHAT}, provider: {{kind: openai, base_url: '{double.url}', model: m}}}}\n"
    config = write_config(tmp_path, models)
    config.write_text(config.read_text() + "drain_seconds: 120\n")
    body = {"model": "slow-echo", "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))}],
            "max_tokens": 100, "stream": True}
    return config, body


def test_a_second_ctrl_c_cuts_the_drain_short(tmp_path, double):
    """Ctrl-C pressed again during the drain: the requests still in flight are cut and the gateway stops at once,
    instead of waiting up to drain_seconds for them."""
    config, body = slow_echo(tmp_path, double, words=60, seconds_a_word=0.25)  # the stream takes 15 s
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


def test_a_hangup_drains_and_stops_as_sigterm_does(tmp_path, double):
    """SIGHUP (the terminal or ssh session `portico serve` runs in closed, a `kill -HUP` meant to reopen logs) killed
    it by the signal's default action: exit -1, the streams in flight cut, no "Portico stopped.", and its run
    directory left in /tmp. It now drains and stops as SIGTERM does."""
    config, body = slow_echo(tmp_path, double, words=20, seconds_a_word=0.05)
    with running_gateway(tmp_path / "data", config=config) as gateway:
        lines: list[str] = []
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            headers = {"Authorization": f"Bearer {gateway.secret}"}
            with client.stream("POST", CHAT, json=body, headers=headers) as answer:
                for line in filter(None, answer.iter_lines()):
                    lines.append(line)
                    if len(lines) == 1:  # the stream is under way
                        gateway.process.send_signal(signal.SIGHUP)
        assert gateway.process.wait(timeout=30) == 0
    assert lines[-1] == "data: [DONE]"
    log = gateway.log_path.read_text()
    assert "stopping: no new connections" in log
    (run_dir,) = re.findall(r"unix:(/\S+)/grpc.sock", log)
    assert not os.path.exists(run_dir)


def test_a_killed_serves_run_directory_is_removed_by_the_next_serve(tmp_path, monkeypatch):
    """A serve killed by SIGKILL (the OOM killer) left its run directory in TMPDIR (Envoy's config, sockets, metrics
    files): a unit restarted after each kill piled them up on a tmpfs. The next serve removes those whose serve is
    gone, and nothing of an older Portico's (no lock file) or of a serve still running."""
    temp = Path(tempfile.mkdtemp(prefix="pt-"))  # short: the run directory's socket paths must fit
    try:
        monkeypatch.setenv("TMPDIR", str(temp))
        with running_gateway(tmp_path / "killed") as killed:
            killed.process.kill()
            killed.process.wait(timeout=10)
        (left,) = temp.glob("portico-*")
        settled = time.time() - 120  # a directory made a moment ago may be another serve's, not locked yet
        os.utime(left / "serve.lock", (settled, settled))
        older = temp / "portico-olderver"
        older.mkdir()
        with running_gateway(tmp_path / "next") as next_serve:
            assert not left.exists() and older.exists()
            (own,) = set(temp.glob("portico-*")) - {older}
            assert (own / "grpc.sock").exists()
            key = {"Authorization": f"Bearer {next_serve.secret}"}
            assert httpx.get(f"{next_serve.base_url}/v1/models", headers=key).status_code == 200
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _read_stream(chunks, text_of, under_way: threading.Event) -> tuple[list[str], Exception | None]:
    """Iterate an SDK stream to its end: (the texts it gave, the exception it raised or None)."""
    texts: list[str] = []
    try:
        for chunk in chunks:
            if text := text_of(chunk):
                texts.append(text)
                under_way.set()
    except Exception as exc:  # noqa: BLE001 - what the SDK raised is what the test looks at
        return texts, exc
    return texts, None


def _chat_text(chunk) -> str:
    return chunk.choices[0].delta.content or "" if chunk.choices else ""


def _message_text(event) -> str:
    return event.delta.text if event.type == "content_block_delta" else ""


@pytest.mark.parametrize("signals, drain_seconds", [(1, 1), (2, 120)], ids=["drain-ran-out", "second-sigterm"])
def test_streams_cut_by_the_stop_end_with_the_dialects_error_event(tmp_path, double, signals, drain_seconds):
    """A stream still running when the drain ends (its time is up, or a second SIGTERM) was not finished: each SDK
    raises a 503 saying the server is shutting down, instead of taking the cut answer as complete, and the access
    log does not blame the caller (499)."""
    slow = Cue(frame_delay=0.25)  # one word every 0.25 s: 60 words take 15 s
    double.cue(slow, slow)
    provider = f"{{kind: openai, base_url: '{double.url}', model: m}}"
    models = (f"  - {{id: slow-chat, endpoint: {CHAT}, provider: {provider}}}\n"
              f"  - {{id: slow-messages, endpoint: /v1/messages, provider: {provider}}}\n")
    config = write_config(tmp_path, models)
    config.write_text(config.read_text() + f"drain_seconds: {drain_seconds}\n")
    words = [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}]
    with running_gateway(tmp_path / "data", config=config) as gateway:
        oai = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
        claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)
        chat_going, messages_going = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            chat = pool.submit(_read_stream, oai.chat.completions.create(
                model="slow-chat", messages=words, max_tokens=100, stream=True), _chat_text, chat_going)
            messages = pool.submit(_read_stream, claude.messages.create(
                model="slow-messages", messages=words, max_tokens=100, stream=True), _message_text, messages_going)
            assert chat_going.wait(30) and messages_going.wait(30)
            started = time.monotonic()
            for _ in range(signals):
                sigterm(gateway.process)
                time.sleep(0.3)
            (chat_texts, chat_error), (message_texts, message_error) = chat.result(30), messages.result(30)
        assert gateway.process.wait(timeout=30) == 0
        assert time.monotonic() - started < 10  # the streams alone would have needed 15 s
    assert chat_texts and len(chat_texts) < 60 and message_texts and len(message_texts) < 60
    assert isinstance(chat_error, openai.APIError), chat_error
    assert chat_error.body["type"] == "service_unavailable_error" and chat_error.body["code"] == "service_unavailable"
    assert "shutting down" in chat_error.message
    assert isinstance(message_error, anthropic.APIStatusError), message_error
    assert message_error.body["error"]["type"] == "overloaded_error"  # Anthropic's type for the status
    assert "shutting down" in message_error.body["error"]["message"]
    lines = [orjson.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith('{"ts":')]
    cut = {line["rpc"]: (line["status"], line["code"])
           for line in lines if line["model"] in ("slow-chat", "slow-messages")}
    # A stream cut after its 200 is logged like any stream that failed in-band: its 200, with the error's code.
    assert cut == {"ChatService/CreateChatCompletionHttp": (200, "service_unavailable"),
                   "MessageService/CreateMessageHttp": (200, "service_unavailable")}


def test_a_stop_signal_while_starting_stops_it_cleanly_once_up(tmp_path):
    """SIGTERM while it starts (an impatient process manager, a Ctrl-C at once) killed the process by the signal's
    default action: exit -15, no "Portico stopped.". It is now acted on once all is up."""
    port, admin_port, metrics_port = free_ports(3)
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "--log-level", "info", "--data-dir", str(tmp_path / "data"), "serve",
         "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0,
    )
    try:
        for line in process.stderr:  # the model has loaded; Envoy is not started yet
            if "gRPC server listening" in line:
                break
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, out
    assert "Portico is listening" in out and out.rstrip().endswith("Portico stopped.")
    # how to stop it, said where a first `make serve` looks (it said only where to connect)
    assert "Ctrl-C or SIGTERM stops it" in out


def test_envoy_dying_stops_the_whole_gateway_loudly_naming_the_signal(tmp_path, double):
    """Never half-up: without Envoy nobody reaches the server, so `portico serve` stops with exit code 1. Its log
    said `Envoy exited with -9`, a raw return code, where a dead worker's line names the signal."""
    config, _ = slow_echo(tmp_path, double, words=1, seconds_a_word=0)
    with running_gateway(tmp_path / "data", config=config) as gateway:
        found = subprocess.run(["pgrep", "-P", str(gateway.process.pid), "-f", "envoy"], capture_output=True,
                               text=True)
        (envoy_pid,) = [int(pid) for pid in found.stdout.split()]
        os.kill(envoy_pid, signal.SIGKILL)
        assert gateway.process.wait(timeout=15) == 1
    log = gateway.log_path.read_text()
    assert "Envoy exited, killed by SIGKILL; stopping Portico." in log


def test_a_drain_tells_kept_alive_connections_to_go_elsewhere(tmp_path, double):
    """Behind a load balancer, a client's pooled connection to a draining host would get 503 after 503 (the SDKs
    retry on the same connection) for up to drain_seconds: its HTTP/1.1 answers now say `connection: close` and
    the connection closes, and an HTTP/2 connection is sent GOAWAY, so the next request opens a connection elsewhere.
    A stream under way runs to its end."""
    double.reset()  # no cue left by an earlier test: this stream must take its 3 s
    config, body = slow_echo(tmp_path, double, words=12, seconds_a_word=0.25)  # the drain lasts that long
    with running_gateway(tmp_path / "data", config=config) as gateway:
        headers = {"Authorization": f"Bearer {gateway.secret}"}
        port = int(gateway.base_url.rsplit(":", 1)[1])
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        kept.request("GET", "/v1/models", headers=headers)
        assert kept.getresponse().read() and kept.sock is not None  # kept alive
        h2_socket, h2_conn = _h2_connection(port)
        assert _h2_get(h2_socket, h2_conn, 1, headers) == (200, False)
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            with client.stream("POST", CHAT, json=body, headers=headers) as answer:
                lines = []
                for line in filter(None, answer.iter_lines()):
                    lines.append(line)
                    if len(lines) == 1:  # the stream is under way
                        gateway.process.send_signal(signal.SIGTERM)
                        _wait_for("stopping: no new connections", gateway.log_path)
                        try:
                            kept.request("GET", "/v1/models", headers=headers)
                            refused = kept.getresponse()
                            refused.read()
                            assert (refused.status, refused.getheader("connection")) == (503, "close")
                        except (http.client.RemoteDisconnected, ConnectionResetError):
                            pass  # or Envoy closed it while it was idle: either way the client must reconnect
                        assert kept.sock is None  # closed, as told
                        status, went_away = _h2_get(h2_socket, h2_conn, 3, headers)
                        assert status in (503, None) and went_away
        h2_socket.close()
        assert gateway.process.wait(timeout=30) == 0
    assert lines[-1] == "data: [DONE]"


def _wait_for(text: str, log_path: Path) -> None:
    deadline = time.monotonic() + 10
    while text not in log_path.read_text():
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.02)


def _h2_connection(port: int):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def _h2_get(sock, conn, stream_id: int, headers: dict) -> tuple[int | None, bool]:
    """GET /v1/models on stream `stream_id`: (its status, None when the connection closed first; whether a GOAWAY
    with NO_ERROR came). The answer's frames are read by hand: h2's own state machine takes a GOAWAY as the
    connection's end and refuses the answer that follows it (as httpx's HTTP/2 client does, encode/httpcore#730)."""
    conn.send_headers(stream_id, [(":method", "GET"), (":path", "/v1/models"), (":scheme", "http"),
                                  (":authority", "127.0.0.1"), *((k.lower(), v) for k, v in headers.items())],
                      end_stream=True)
    sock.sendall(conn.data_to_send())
    buffer, status, went_away = b"", None, False
    while True:
        while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
            data = sock.recv(65536)
            if not data:
                return status, went_away
            buffer += data
        length, kind, flags, stream = (int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4],
                                       int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF)
        payload, buffer = buffer[9:9 + length], buffer[9 + length:]
        if kind == 0x7:  # GOAWAY: last stream id, error code
            went_away = int.from_bytes(payload[4:8], "big") == 0
        elif kind == 0x1:  # HEADERS, decoded with the connection's HPACK table, which every block updates
            if flags & 0x8:  # PADDED
                payload = payload[1:len(payload) - payload[0]]
            if flags & 0x20:  # PRIORITY
                payload = payload[5:]
            block = {name if isinstance(name, str) else name.decode(): value
                     for name, value in conn.decoder.decode(payload)}
            if stream == stream_id:
                status = int(block.get(":status", 0))
        if stream == stream_id and kind in (0x0, 0x1) and flags & 0x1:  # END_STREAM
            return status, went_away
