"""The architecture's floor: what Portico's front door costs before any of Portico's own work.

`python -m bench.floor --port P --admin-port A --handler-us N` serves POST /v1/chat/completions through the same
stack as `portico serve` (envoy.yaml with its Lua filter and transcoder, a grpc.aio server on uvloop behind a unix
socket, the error interceptor with its telemetry) in front of a ChatService whose REST handler does nothing but
use N microseconds of CPU, send x-ratelimit-* initial metadata as the real pipeline does, and answer with a fixed
completion: no key check, no limits, no translation, no upstream call. `python -m bench --floor 0,100,...` runs the
JSON load against it for each N, so the table shows how many req/s are left for a handler of a given cost.

With `--upstream URL` the handler instead does the one thing no gateway can skip: it parses the caller's body, sets
the upstream's model name, POSTs it to `URL/chat/completions` on a pooled connection (Portico's own client,
server/providers/http_upstream.py, default settings), parses the answer and sends it back re-encoded. A body
with `"stream": true` gets the upstream's stream the same way: each server-sent event parsed and re-encoded, and
the events that are ready together sent as one message (server/services/streaming.py `coalesced`, as Portico
does). Still no key, no limits, no translation, no telemetry beyond the interceptor's: what the design (Envoy,
grpc.aio, the upstream client) costs for a gateway that forwards a request and its answer. `python -m bench
--floor upstream` runs it, for JSON and streamed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import grpc
import orjson
import uvloop
from google.api import httpbody_pb2

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import ADMIN_SOCKET, EnvoyProcess, load_template, render_config, repo_root
from portico.v1 import chat_service_pb2_grpc
from server.app import SERVER_OPTIONS
from server.domain_models import UpstreamSpec
from server.heap import settle_heap
from server.observability import Telemetry
from server.providers.http_upstream import HttpUpstream
from server.render.sse import DONE, sse_event
from server.services.interceptor import ErrorInterceptor
from server.services.streaming import coalesced

ANSWER = orjson.dumps({
    "id": "chatcmpl-floor", "object": "chat.completion", "created": 1767225600, "model": "family-a-5.5",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! This is a fixed answer."},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
})
# As many headers as an admitted request gets (server/limits: both kinds limited).
RATE_LIMIT_HEADERS = tuple((f"x-ratelimit-{what}-{kind}", value) for kind in ("requests", "tokens")
                           for what, value in (("limit", "1000"), ("remaining", "999"), ("reset", "60ms")))


class _Floor(chat_service_pb2_grpc.ChatServiceServicer):
    """Both REST bindings, as Envoy routes them: JSON bodies reach the unary twin, the streaming RPC what a body
    with "stream": true reaches (a JSON body that reaches it anyway is answered in one message). The x-ratelimit-*
    headers travel as Portico's do (server/services/dialect.py): trailing metadata on the twin, initial metadata on
    the stream."""

    async def CreateChatCompletionHttp(self, request, context):
        body = orjson.loads(request.data)
        if not body.get("stream"):
            answer = await self.answer(body)
            await context.send_initial_metadata(RATE_LIMIT_HEADERS)
            yield answer
            return
        await context.send_initial_metadata(RATE_LIMIT_HEADERS)
        async with aclosing(coalesced(self.events(body))) as frames:
            async for data in frames:
                yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=data)

    async def CreateChatCompletionHttpUnary(self, request, context):
        answer = await self.answer(orjson.loads(request.data))
        context.set_trailing_metadata(RATE_LIMIT_HEADERS)
        return answer

    async def answer(self, body: dict) -> httpbody_pb2.HttpBody:
        raise NotImplementedError

    def events(self, body: dict) -> AsyncIterator[bytes]:
        """The SSE frames of a streamed answer."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


class FloorChat(_Floor):
    def __init__(self, handler_seconds: float) -> None:
        self._handler_seconds = handler_seconds

    async def answer(self, body: dict) -> httpbody_pb2.HttpBody:
        # A busy loop, not a sleep: the cost stands for Python work done on the event loop's thread.
        end = time.perf_counter() + self._handler_seconds
        while time.perf_counter() < end:
            pass
        return httpbody_pb2.HttpBody(content_type="application/json", data=ANSWER)


class ForwardingChat(_Floor):
    """Forwards each body to the upstream and its answer back, as Portico's provider does, and nothing else."""

    def __init__(self, upstream: str) -> None:
        self._upstream = HttpUpstream(UpstreamSpec(base_url=upstream.rstrip("/"), model="mock-gpt"), auth_headers={},
                                      secret=None)

    async def answer(self, body: dict) -> httpbody_pb2.HttpBody:
        body["model"] = "mock-gpt"
        answer = await self._upstream.post_json("chat/completions", body, model_id="floor")
        return httpbody_pb2.HttpBody(content_type="application/json", data=orjson.dumps(answer))

    async def events(self, body: dict) -> AsyncIterator[bytes]:
        body["model"] = "mock-gpt"
        async with self._upstream.stream("chat/completions", body, model_id="floor") as events:
            async for event in events:
                if event.data == b"[DONE]":
                    break
                yield sse_event(orjson.loads(event.data))
        yield DONE

    async def close(self) -> None:
        await self._upstream.close()


async def serve(port: int, admin_port: int, handler_us: float, upstream: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="portico-floor-") as run_dir:
        socket_path = Path(run_dir) / "grpc.sock"
        server = grpc.aio.server(interceptors=[ErrorInterceptor(Telemetry())], options=SERVER_OPTIONS)
        servicer: _Floor = ForwardingChat(upstream) if upstream else FloorChat(handler_us / 1e6)
        chat_service_pb2_grpc.add_ChatServiceServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
        settle_heap()  # as portico serve does
        config = render_config(load_template(), listen_port=port, admin_port=admin_port,
                               upstreams=[f"unix:{socket_path}"], admin_socket=Path(run_dir, ADMIN_SOCKET),
                               descriptor_set=DESCRIPTOR_SET,
                               lua_dir=repo_root() / "gateway" / "lua")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with EnvoyProcess(config, Path(run_dir)):
            what = f"forwarding to {upstream}" if upstream else f"handler {handler_us:g} us"
            print(f"floor listening on 127.0.0.1:{port} ({what})", flush=True)
            await stop.wait()
        await server.stop(None)
        await servicer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--handler-us", type=float, default=0.0, help="CPU microseconds the handler uses")
    parser.add_argument("--upstream", help="forward each request to this OpenAI-compatible base URL instead")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.admin_port, args.handler_us, args.upstream))


if __name__ == "__main__":
    main()
