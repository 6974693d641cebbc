"""portico.client against failures on cue: real local servers (HTTP and gRPC, on 127.0.0.1) that answer the first
requests from a script of errors in the gateway's format (or, for status 0, a pause of `retry_after` seconds before
forwarding) and forward the rest to the real gateway. They count what
reaches them, so the number of attempts is observed, not inferred."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from gateway.envoy import free_ports
from portico.client import (
    CHANNEL_OPTIONS, APIConnectionError, APITimeoutError, AsyncPorticoClient, AuthenticationError, BadRequestError,
    GrpcTransport, HttpTransport, InternalServerError, NotFoundError, Operation, PermissionDeniedError, PorticoClient,
    RetriesExhausted, RetryPolicy, ServiceUnavailableError,
)
from portico.v1 import chat_service_pb2_grpc, error_pb2, key_pb2, key_service_pb2_grpc, model_service_pb2_grpc

HI = [{"role": "user", "content": "Hi"}]
UPDATE_KEY = Operation(key_service_pb2_grpc.KeyServiceStub, "UpdateKey", key_pb2.UpdateKeyRequest,
                       key_pb2.UpdateKeyResponse, "PATCH", "/v1/admin/keys/{id}")
ROWS = {  # the gateway's error table: status -> (gRPC code, code, type)
    400: (grpc.StatusCode.INVALID_ARGUMENT, "invalid_request", "invalid_request_error"),
    401: (grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key", "authentication_error"),
    403: (grpc.StatusCode.PERMISSION_DENIED, "permission_denied", "permission_error"),
    404: (grpc.StatusCode.NOT_FOUND, "model_not_found", "invalid_request_error"),
    500: (grpc.StatusCode.INTERNAL, "internal_error", "server_error"),
    503: (grpc.StatusCode.UNAVAILABLE, "service_unavailable", "service_unavailable_error"),
}
TYPED = {400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
         500: InternalServerError, 503: ServiceUnavailableError}


class HttpFaults:
    """An HTTP server: each scripted (status, retry_after) is answered as Portico would; then it forwards."""

    def __init__(self, upstream: str, script: list[tuple[int, float]], port: int = 0) -> None:
        self.script, self.requests, self.upstream = list(script), 0, upstream
        self.closing = threading.Event()
        faults = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.exchange(self.rfile.read(int(self.headers["content-length"])))

            do_PATCH = do_POST

            def do_GET(self) -> None:
                self.exchange(None)

            def exchange(self, body: bytes | None) -> None:
                status, headers, answer = faults.answer(self.command, self.path, body, self.headers["authorization"])
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def target(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, method: str, path: str, body: bytes | None, authorization: str) -> tuple[int, dict, bytes]:
        self.requests += 1
        if self.script and self.script[0][0] == 0 and self.closing.wait(self.script.pop(0)[1]):
            return 503, {}, b""  # a slow answer, cut short by the end of the test
        if self.script:
            status, retry_after = self.script.pop(0)
            _, code, type_ = ROWS[status]
            error = {"error": {"message": f"scripted {status}", "type": type_, "param": None, "code": code}}
            headers = {"content-type": "application/json"}
            if retry_after:
                headers["retry-after-ms"] = str(int(retry_after * 1000))
            return status, headers, json.dumps(error).encode()
        forwarded = httpx.request(method, self.upstream + path, content=body, timeout=60,
                                  headers={"authorization": authorization, "content-type": "application/json"})
        return forwarded.status_code, {"content-type": forwarded.headers["content-type"]}, forwarded.content

    def __enter__(self) -> HttpFaults:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class GrpcFaults(chat_service_pb2_grpc.ChatServiceServicer, model_service_pb2_grpc.ModelServiceServicer,
                 key_service_pb2_grpc.KeyServiceServicer):
    """A gRPC server: scripted failures carry Portico's status details (or none, for status 0 retry_after -1)."""

    def __init__(self, upstream: str, script: list[tuple[int, float]], port: int = 0) -> None:
        self.script, self.requests = list(script), 0
        self.closing = threading.Event()
        self.channel = grpc.insecure_channel(upstream)
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        chat_service_pb2_grpc.add_ChatServiceServicer_to_server(self, self.server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(self, self.server)
        key_service_pb2_grpc.add_KeyServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def CreateChatCompletion(self, request, context):
        self.scripted(context)
        metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        return chat_service_pb2_grpc.ChatServiceStub(self.channel).CreateChatCompletion(request, metadata=metadata)

    def ListModels(self, request, context):
        self.scripted(context)
        metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        return model_service_pb2_grpc.ModelServiceStub(self.channel).ListModels(request, metadata=metadata)

    def UpdateKey(self, request, context):
        self.scripted(context)
        metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        return key_service_pb2_grpc.KeyServiceStub(self.channel).UpdateKey(request, metadata=metadata)

    def scripted(self, context) -> None:
        """The next scripted answer, if any: a slow one, or a failure that aborts the call."""
        self.requests += 1
        if self.script and self.script[0][0] == 0 and self.closing.wait(self.script.pop(0)[1]):
            context.abort(grpc.StatusCode.CANCELLED, "closing")  # a slow answer, cut short by the end of the test
        if self.script:
            status, retry_after = self.script.pop(0)
            grpc_code, code, type_ = ROWS[status]
            if retry_after < 0:  # a bare status, as grpc itself or a proxy would answer
                context.abort(grpc_code, f"bare {grpc_code.name}")
            detail = any_pb2.Any()
            detail.Pack(error_pb2.ErrorResponse(
                error=error_pb2.ApiError(message=f"scripted {status}", type=type_, code=code),
                http_status=status, retry_after_seconds=retry_after))
            context.abort_with_status(rpc_status.to_status(status_pb2.Status(
                code=grpc_code.value[0], message=f"scripted {status}", details=[detail])))

    def __enter__(self) -> GrpcFaults:
        self.server.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.closing.set()
        self.server.stop(1).wait()  # its handlers end before the channel they forward on is closed
        self.channel.close()


def faults(gateway, transport: str, script: list[tuple[int, float]], port: int = 0):
    if transport == "grpc":
        return GrpcFaults(f"127.0.0.1:{gateway.port}", script, port)
    return HttpFaults(gateway.base_url, script, port)


def client_for(transport: str, target: str, secret: str, *, asyncio: bool = False, **options):
    kind = AsyncPorticoClient if asyncio else PorticoClient
    return kind.over_grpc(target, secret, **options) if transport == "grpc" else kind.over_rest(target, secret, **options)


class Recorder:
    def __init__(self, draws: list[float]) -> None:
        self.draws, self.sleeps = list(draws), []

    def random(self) -> float:
        return self.draws.pop(0)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def test_503_and_500_are_retried_with_jittered_backoff_then_the_gateway_answers(gateway, transport):
    record = Recorder([0.1, 0.75])
    policy = RetryPolicy(attempts=3, base=1.0, cap=4.0)
    with faults(gateway, transport, [(503, 0.25), (500, 0)]) as proxy, client_for(
            transport, proxy.target, gateway.secret, retry=policy, sleep=record.sleep, random=record.random) as client:
        completion = client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert completion.model == "family-a-5.5" and completion.usage.completion_tokens == 1  # the real gateway's answer
    assert proxy.requests == 3
    assert record.sleeps == [0.25, 1.5]  # max(hint 0.25, 0.1 * 1.0), then 0.75 * 2.0 (no hint)


def test_retries_stop_at_the_maximum_and_surface_the_last_error(gateway, transport):
    record = Recorder([0.9, 0.9, 0.9])
    policy = RetryPolicy(attempts=4, base=2.0, cap=5.0)
    with faults(gateway, transport, [(503, 0), (500, 0), (503, 0), (500, 0), (500, 0)]) as proxy, client_for(
            transport, proxy.target, gateway.secret, retry=policy, sleep=record.sleep, random=record.random) as client:
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert proxy.requests == 4 and len(proxy.script) == 1
    assert record.sleeps == pytest.approx([1.8, 3.6, 4.5])  # 0.9 of ceilings 2, 4, then the cap 5
    last = caught.value.last
    assert isinstance(last, InternalServerError)
    assert (last.status, last.code, last.type, last.message) == (500, "internal_error", "server_error", "scripted 500")
    assert [type(e) for _, e in caught.value.failures] == [ServiceUnavailableError, InternalServerError] * 2


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_reach_the_server_once(gateway, transport, status):
    record = Recorder([])
    with faults(gateway, transport, [(status, 0)]) as proxy, client_for(
            transport, proxy.target, gateway.secret, retry=RetryPolicy(attempts=5), sleep=record.sleep) as client:
        with pytest.raises(TYPED[status]) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
        assert proxy.requests == 1 and record.sleeps == []
        assert (caught.value.status, caught.value.code) == (status, ROWS[status][1])
        assert client.chat_completion("family-a-5.5", HI, max_tokens=1).model == "family-a-5.5"


def test_a_bare_grpc_status_maps_through_the_table(gateway):
    record = Recorder([0.5])
    with faults(gateway, "grpc", [(503, -1)]) as proxy, client_for(
            "grpc", proxy.target, gateway.secret, sleep=record.sleep, random=record.random) as client:
        assert client.chat_completion("family-a-5.5", HI, max_tokens=1).model == "family-a-5.5"
    assert proxy.requests == 2 and record.sleeps == [0.25]
    with faults(gateway, "grpc", [(503, -1)]) as proxy, client_for(
            "grpc", proxy.target, gateway.secret, retry=RetryPolicy(attempts=1)) as client:
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    error = caught.value.last
    assert isinstance(error, ServiceUnavailableError) and error.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert (error.status, error.code, error.message, error.retry_after) == (
        503, "service_unavailable", "bare UNAVAILABLE", None)


def test_an_answer_past_the_clients_timeout_is_an_api_timeout_and_not_sent_again(gateway, transport):
    """The request went out and may still be running: neither retried nor blamed on an upstream (over gRPC, the
    client's own deadline is not the gateway's 504)."""
    record = Recorder([0.5] * 3)
    with faults(gateway, transport, [(0, 2.0)]) as proxy, client_for(
            transport, proxy.target, gateway.secret, timeout=0.5, sleep=record.sleep, random=record.random) as client:
        with pytest.raises(APITimeoutError) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert proxy.requests == 1 and record.sleeps == [] and caught.value.code == "timeout"
    assert caught.value.message.startswith("No answer within the client's timeout")  # REST said "ReadTimeout: "


def test_a_transport_made_over_a_channel_or_http_client_of_ones_own_keeps_its_timeout(gateway, transport):
    """client.md's way to other channel or httpx options. Over REST the transport's `timeout` was dropped for the
    httpx client's own, whose default is 5 s: every answer slower than that was an APITimeoutError."""
    with faults(gateway, transport, [(0, 2.0)]) as proxy:
        transport_ = (GrpcTransport(grpc.insecure_channel(proxy.target, CHANNEL_OPTIONS), gateway.secret, timeout=0.5)
                      if transport == "grpc" else
                      HttpTransport(proxy.target, gateway.secret, timeout=0.5, http=httpx.Client(timeout=60)))
        with PorticoClient(transport_) as client, pytest.raises(APITimeoutError):
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert proxy.requests == 1


def test_a_patch_past_the_clients_timeout_is_not_sent_again_either(gateway, transport):
    """Only a GET changes nothing. Over REST a PATCH (UpdateKey) whose answer was late was a plain connection error
    and sent twice more, where over gRPC the same call was an APITimeoutError, sent once."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    key_id = gateway.cli("keys", "create", "--name", "late", "--all-models").stdout.split()[2]
    record = Recorder([0.5] * 3)
    with faults(gateway, transport, [(0, 2.0)]) as proxy, client_for(
            transport, proxy.target, admin, timeout=0.5, sleep=record.sleep, random=record.random) as client:
        with pytest.raises(APITimeoutError):
            client.call(UPDATE_KEY, {"id": key_id, "name": "renamed"})
    assert proxy.requests == 1 and record.sleeps == []


def test_a_read_past_the_clients_timeout_is_tried_again(gateway, transport):
    """Listing models changes nothing, so an answer that did not come in time is asked for again, over gRPC as over
    REST (a POST is not: see above)."""
    record = Recorder([0.5] * 3)
    with faults(gateway, transport, [(0, 2.0)]) as proxy, client_for(
            transport, proxy.target, gateway.secret, timeout=0.5, sleep=record.sleep, random=record.random) as client:
        assert client.list_models().data
    assert proxy.requests == 2 and len(record.sleeps) == 1


def test_connection_errors_are_retried_then_surfaced(transport):
    (port,) = free_ports(1)  # nothing listens there
    target = f"127.0.0.1:{port}" if transport == "grpc" else f"http://127.0.0.1:{port}"
    record = Recorder([0.5, 0.5])
    with client_for(transport, target, "pk-x", retry=RetryPolicy(attempts=3, base=0.1, cap=1.0),
                    sleep=record.sleep, random=record.random) as client:
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert len(caught.value.failures) == 3 and record.sleeps == [0.05, 0.1]
    expected = ServiceUnavailableError if transport == "grpc" else APIConnectionError  # gRPC says UNAVAILABLE
    assert all(type(error) is expected for _, error in caught.value.failures)


@pytest.mark.parametrize(("transport", "use_asyncio"), [("grpc", False), ("grpc", True), ("rest", False)])
async def test_a_gateway_back_after_an_outage_answers_the_next_calls_retries(gateway, transport, use_asyncio):
    """A gateway down for a few seconds, then back on its port: the next call's retries reach it. (grpc's own
    reconnect backoff, 1 s and growing 1.6-fold by default, fails calls fast for seconds after it is back.)"""
    (port,) = free_ports(1)  # the gateway is down: nothing listens there
    target = f"127.0.0.1:{port}" if transport == "grpc" else f"http://127.0.0.1:{port}"
    sleep = asyncio.sleep if use_asyncio else time.sleep
    client = client_for(transport, target, gateway.secret, asyncio=use_asyncio, sleep=sleep)

    async def call(policy: RetryPolicy) -> object:
        client.retry = policy
        answer = client.chat_completion("family-a-5.5", HI, max_tokens=1)
        return await answer if use_asyncio else answer

    down_until = time.monotonic() + 3.0
    while time.monotonic() < down_until:  # callers keep trying while it is down
        with pytest.raises(RetriesExhausted):
            await call(RetryPolicy(attempts=1))
        await asyncio.sleep(0.1)
    with faults(gateway, transport, [], port) as proxy:  # back, on the same port
        completion = await call(RetryPolicy(attempts=6, base=0.2, cap=0.2, jitter=False))  # 1 s of retries
        await client.close() if use_asyncio else client.close()
    assert completion.model == "family-a-5.5" and proxy.requests == 1


async def test_the_asyncio_client_retries_the_same_way(gateway, transport):
    sleeps = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    with faults(gateway, transport, [(500, 0), (503, 0.5)]) as proxy:
        async with client_for(transport, proxy.target, gateway.secret, asyncio=True, sleep=sleep,
                              retry=RetryPolicy(attempts=3, base=0.2, cap=1.0), random=lambda: 1.0) as client:
            completion = await client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert completion.model == "family-a-5.5" and proxy.requests == 3 and sleeps == [0.2, 0.5]
