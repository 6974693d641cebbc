"""The whole product as a user runs it: `portico serve` (gRPC server + real Envoy) on free loopback ports.

Every gateway logs at debug level into the session's temporary directory; once the last gateway has stopped,
every log line there (the gateways' stderr, access log included, and Envoy's logs) is scanned for API keys
(tests/e2e/log_scan.py): a key in any log fails the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import yaml

from gateway.envoy import free_ports, repo_root
from tests.e2e.log_scan import scan_logs
from tests.redis_support import start_redis
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, write_config


@dataclass(frozen=True)
class Gateway:
    port: int
    admin_port: int
    secret: str  # the development key printed on first start
    data_dir: Path
    log_path: Path
    metrics_port: int = 0
    process: subprocess.Popen | None = None
    config: Path | None = None  # the --config the CLI needs too (a key store in PostgreSQL, say)
    printed: tuple[str, ...] = ()  # what serve printed to stdout until it was listening

    @property
    def envoy_log_path(self) -> Path:
        return self.data_dir / "envoy.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def envoy_access_lines(self, request_id: str) -> list[dict]:
        """The lines of Envoy's access log (its replies the server never saw) naming `request_id`, once there are
        any: each Envoy worker flushes its lines every second or so (at most 15 s waited)."""
        log = self.data_dir / "envoy-access.log"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and request_id not in (log.read_text() if log.exists() else ""):
            time.sleep(0.2)
        return [json.loads(line) for line in log.read_text().splitlines() if request_id in line]

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "server.cli", *(["--config", str(self.config)] if self.config else []),
             "--data-dir", str(self.data_dir), *args],
            capture_output=True, text=True, timeout=30, check=True,
        )


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A redis-server of the module's own, for a gateway whose limits live in it (default_config_with_limits)."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def default_config_with_limits(directory: Path, **limits) -> Path:
    """The default configuration (server/default.yaml) with `limits` settings changed, written into `directory`."""
    raw = yaml.safe_load((repo_root() / "server" / "default.yaml").read_text())
    raw["limits"].update(limits)
    config = directory / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


@contextlib.contextmanager
def running_gateway(data_dir: Path, *serve_args: str, config: Path | None = None,
                    dev_key: bool = True) -> Iterator[Gateway]:
    """`portico serve` on free ports until the block ends; its stderr goes to data_dir/../gateway*.log.
    `dev_key`: it must print a development key (False: a shared key store that has keys already)."""
    log_path = data_dir.parent / f"{data_dir.name}.log"
    port, admin_port, metrics_port = free_ports(3)
    global_args = ["--config", str(config)] if config else []
    if config and dev_key:  # may configure upstreams, where a development key is only made when asked for
        serve_args = ("--dev-key", *serve_args)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--log-level", "debug", *global_args, "--data-dir", str(data_dir),
             "serve", "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port),
             *serve_args],
            stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            process_group=0,  # as a shell job: a test can send the group a terminal's Ctrl-C
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    secret = ""
    printed: list[str] = []
    deadline = time.monotonic() + 90
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"portico serve did not start:\n{log_path.read_text()}") from None
            printed.append(line)
            if match := re.search(r"\b(pk-\S+)", line):
                secret = match.group(1)
            if "Portico is listening" in line:
                break
        assert secret or not dev_key, "the first start must print a development key"
        yield Gateway(port, admin_port, secret, data_dir, log_path, metrics_port, process, printed=tuple(printed))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def upstream_gateway(directory: Path, models_yaml: str) -> Iterator[Gateway]:
    """`portico serve` whose configuration has these `models:` (pointing at test upstreams), with the upstream key
    in the environment it inherits, removed again afterwards."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        with running_gateway(directory / "data", config=write_config(directory, models_yaml)) as gateway:
            yield gateway
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


@pytest.fixture(scope="session")
def gateway(tmp_path_factory) -> Gateway:
    with running_gateway(tmp_path_factory.mktemp("gateway-data")) as gateway:
        yield gateway



@pytest.fixture(scope="module")
def oai(gateway: Gateway) -> openai.OpenAI:
    """The official openai SDK on the module's gateway (the session's, or one the module starts itself)."""
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)


@pytest.fixture(scope="module")
def claude(gateway: Gateway) -> anthropic.Anthropic:
    """The official anthropic SDK on the module's gateway."""
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)


@pytest.fixture(scope="session", autouse=True)
def no_key_in_any_log(tmp_path_factory) -> None:
    """Set up before, so torn down after, every gateway of the session: then no key may be in any log line."""
    yield
    report = scan_logs(tmp_path_factory.getbasetemp())
    assert not report.leaks, "API keys found in logs:\n" + "\n".join(report.leaks)
    # A scan that silently reads nothing proves nothing: each gateway leaves its own log beside Envoy's.
    assert report.files >= 2 * report.envoy_logs, f"gateway logs missing: {report}"


@pytest.fixture(scope="module")
def browser():
    """Chromium for the console's tests (tests/e2e/browser.py); started once per module that asks for it."""
    from tests.e2e.browser import chromium  # Playwright is imported only by the tests that drive a browser

    with chromium() as browser:
        yield browser


@pytest.fixture
def tab(browser, gateway, tmp_path):
    """A fresh browser context on the module's gateway (each test signs in for itself)."""
    from tests.e2e.browser import Tab

    tab = Tab(browser, gateway, tmp_path)
    yield tab
    tab.context.close()
