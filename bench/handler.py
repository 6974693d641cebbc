"""Portico's own CPU per request, without gRPC, Envoy or a load generator: `python -m bench.handler`.

The servicers' REST methods are called in-process through the error interceptor, as the gRPC server calls them,
`--concurrency` at a time, against the mock upstream (bench/mock_upstream.py, in its own process), with the
configuration `python -m bench` uses (limits in-process, a key checked on every request, the access log to a file).
It prints the CPU this process spent per request: the handler cost that `python -m bench --floor` turns into req/s.
Run to run it moves about 5 % (streams up to 10 %: how the mock's chunks coalesce varies) where a wrk run moves
10-25 %, so it is the way to compare changes to the request path: run it before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvloop
from google.api import httpbody_pb2

from bench.common import (BENCH_ENV, CHAT_BODY, MESSAGES_BODY, PYTHON, ROOT, STREAM_BODY, Processes, at_least,
                          create_key, subset_of, wait_port, write_portico_config)
from gateway.envoy import free_ports
from server.app import build_core
from server.config import load_config
from server.heap import settle_heap
from server.services.chat import ChatServicer
from server.services.interceptor import ErrorInterceptor
from server.services.messages import MessageServicer


KINDS = ("JSON", "stream", "messages")  # --only's names, as the cases below name them


def _raw(body: dict) -> httpbody_pb2.HttpBody:
    """The request as Envoy hands it to the REST RPCs: the caller's JSON bytes."""
    return httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())


@dataclass(frozen=True)
class CallDetails:  # grpc.HandlerCallDetails
    method: str
    invocation_metadata: tuple = ()


class InProcessContext:
    """The part of grpc.aio.ServicerContext the interceptor and the pipeline use (tests drive servicers so too)."""

    def __init__(self, key: str, request_id: str = "bench-handler") -> None:
        self._metadata = (("authorization", f"Bearer {key}"), ("x-request-id", request_id))

    def invocation_metadata(self):
        return self._metadata

    async def send_initial_metadata(self, metadata) -> None:
        pass

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def trailing_metadata(self):
        return ()

    async def abort(self, code, details, trailing_metadata=()):
        raise RuntimeError(f"the request failed: {code.name} {details}")


async def _run(config_path: Path, key: str, requests: int, concurrency: int,
               only: set[str] | None = None) -> list[tuple[str, float, float]]:
    config = load_config(config_path)
    core = await build_core(config)
    settle_heap()  # as portico serve does once its server is built
    interceptor = ErrorInterceptor(core.telemetry)
    chat = ChatServicer(core.pipeline, default_max_tokens=config.default_max_tokens)
    messages = MessageServicer(core.pipeline)
    # The RPCs Envoy sends each body to: a body without "stream": true goes to the unary twin.
    cases = [  # (--only kind, row name, RPC, its method, request, a marker of its answer)
        ("JSON", "chat JSON", "/portico.v1.ChatService/CreateChatCompletionHttpUnary",
         chat.CreateChatCompletionHttpUnary, _raw(CHAT_BODY), b"fixed answer"),
        ("stream", "chat stream", "/portico.v1.ChatService/CreateChatCompletionHttp", chat.CreateChatCompletionHttp,
         _raw(STREAM_BODY), b"[DONE]"),
        ("messages", "/v1/messages", "/portico.v1.MessageService/CreateMessageHttpUnary",
         messages.CreateMessageHttpUnary, _raw(MESSAGES_BODY), b"fixed answer"),
    ]
    results = []
    try:
        for kind, name, method, behavior, request, marker in cases:
            if only and kind not in only:
                continue
            unary = method.endswith("Unary")

            async def continuation(details, behavior=behavior, unary=unary):
                if unary:
                    return grpc.unary_unary_rpc_method_handler(behavior)
                return grpc.unary_stream_rpc_method_handler(behavior)

            handler = await interceptor.intercept_service(continuation, CallDetails(method))

            async def one() -> bytes:
                if handler.unary_unary:
                    return (await handler.unary_unary(request, InProcessContext(key))).data
                return b"".join([body.data async for body in handler.unary_stream(request, InProcessContext(key))])

            if marker not in await one():
                raise RuntimeError(f"{name}: the answer lacks {marker!r}")

            async def worker(count: int) -> None:
                for _ in range(count):
                    await one()

            await asyncio.gather(*(worker(500 // concurrency) for _ in range(concurrency)))  # warm up
            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
            done = requests // concurrency * concurrency
            results.append((name, 1e6 * (time.process_time() - cpu) / done, done / (time.perf_counter() - wall)))
    finally:
        await core.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.handler", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=at_least(int, 1), default=20000, help="requests per kind (default 20000)")
    parser.add_argument("--concurrency", type=at_least(int, 1), default=16, help="requests at once (default 16)")
    parser.add_argument("--cache", action="store_true",
                        help="every model with a response cache: after the first request of a kind, all are hits")
    parser.add_argument("--store", default="memory",
                        help="limits.store (and so the response cache's store): memory, or a Redis URL")
    parser.add_argument("--only", default="", type=subset_of(KINDS),
                        help="comma-separated subset of: " + ",".join(KINDS) + " (default all)")
    parser.add_argument("--tracing", action="store_true",
                        help="traces on, every request sampled, exported to the mock (its POST /v1/traces)")
    args = parser.parse_args(argv)
    if args.requests < args.concurrency:
        parser.error(f"argument --requests: {args.requests} requests cannot keep --concurrency {args.concurrency} busy")
    run_dir = Path(tempfile.mkdtemp(prefix="portico-bench-handler-"))
    procs = Processes()
    try:
        (mock_port,) = free_ports(1)
        mock = procs.start("mock upstream", [PYTHON, "-m", "bench.mock_upstream", "--port", str(mock_port)],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_port(mock_port, mock, 10, "the mock upstream")
        config_path = write_portico_config(run_dir, f"http://127.0.0.1:{mock_port}/v1", store=args.store)
        if args.cache:
            config = json.loads(config_path.read_text())
            for model in config["models"]:
                model["cache"] = {}
            config_path.write_text(json.dumps(config))
        if args.tracing:  # the export thread runs in this process, so its CPU is counted too
            config = json.loads(config_path.read_text())
            config["tracing"] = {"otlp_endpoint": f"http://127.0.0.1:{mock_port}", "sample_ratio": 1.0}
            config_path.write_text(json.dumps(config))
        key = create_key(config_path)
        os.environ.update(BENCH_ENV)
        only = {kind for kind in args.only.split(",") if kind}
        results = uvloop.run(_run(config_path, key, args.requests, args.concurrency, only))
    except RuntimeError as exc:
        print(f"bench.handler: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.handler: interrupted; stopping what it started", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"Portico's request path in-process (no gRPC, no Envoy), {args.concurrency} at a time against the mock:")
    print(f"{'run':16} {'CPU us/request':>15} {'req/s':>8}")
    for name, micros, rate in results:
        print(f"{name:16} {micros:15.0f} {rate:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
