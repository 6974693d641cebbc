"""A real OpenAI-compatible upstream: `python -m llama_cpp.server` (llama-cpp-python's [server] extra) serving the
embedded model file on 127.0.0.1 and a free port, stopped by whoever started it."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.envoy import free_ports
from server.providers.llamacpp import LlamaCppProvider

MODEL_ALIAS = "smollm2-upstream"


@dataclass
class LlamaServer:
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_llama_server(directory: Path) -> LlamaServer:
    (port,) = free_ports(1)
    log_path = directory / "llama-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(LlamaCppProvider.default_model_path()),
             "--model_alias", MODEL_ALIAS, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
             "--n_threads", "2", "--n_threads_batch", "2", "--verbose", "False"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    server = LlamaServer(port, process, log_path)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{server.url}/models", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"llama_cpp.server did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
