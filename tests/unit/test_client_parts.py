"""portico.client's parts that need no gateway: aliases from configuration, the per-user token bucket, the
bounded queues, and reading REST error bodies and headers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from portico.client import (
    AsyncPorticoClient, AsyncRequestQueue, BadRequestError, ClientRateLimitError, InternalServerError,
    ModelAliases, NotFoundError, PorticoClient, QueueFull, RateLimitError, RequestQueue, Route,
    Operation, ServiceUnavailableError, UserRateLimiter, error_from_http,
)
from portico.v1.chat_pb2 import ChatCompletionChunk, CreateChatCompletionRequest
from portico.v1.chat_service_pb2_grpc import ChatServiceStub


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


ALIASES_YAML = """
aliases:
  chat:
    primary: family-a-5.5
    fallbacks: [family-a-5.4]
  cheap: family-a-5.4
  writer: {primary: family-b-opus-4-8, fallbacks: [family-b-sonnet-4-6, family-b-haiku-4-5-20251001]}
"""


def test_aliases_from_yaml_and_names_that_are_not_aliases(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(ALIASES_YAML)
    aliases = ModelAliases.load(path)
    assert aliases.routes["chat"] == Route("family-a-5.5", ("family-a-5.4",))
    assert aliases.models("cheap") == ("family-a-5.4",)
    assert aliases.models("writer") == ("family-b-opus-4-8", "family-b-sonnet-4-6", "family-b-haiku-4-5-20251001")
    assert aliases.models("family-a-5.5") == ("family-a-5.5",)  # a plain model id, no fallback
    assert ModelAliases.from_config({"x": {"primary": "m"}}).models("x") == ("m",)
    assert ModelAliases().models("anything") == ("anything",)


@pytest.mark.parametrize("entry, message", [
    ({"fallbacks": ["m"]}, "`primary` must be a model id"),
    ({"primary": "m", "fallbacks": "n"}, "`fallbacks` must be a list"),
    ({"primary": "m", "fallbacks": ["n", "m"]}, "appears twice"),
    ({"primary": "m", "fallback": ["n"]}, "expected a model id or"),
    (42, "expected a model id or"),
])
def test_alias_mistakes_are_named(entry, message):
    with pytest.raises(ValueError, match=message) as caught:
        ModelAliases.from_config({"chat": entry})
    assert "'chat'" in str(caught.value)


def test_an_alias_file_without_its_section_is_refused():
    with pytest.raises(ValueError, match="no `aliases:` section"):
        ModelAliases.from_yaml("models: {}")
    assert ModelAliases.from_yaml("chat: m", section=None).models("chat") == ("m",)


def test_token_bucket_bursts_then_refills_at_its_rate_per_user():
    clock = Clock()
    limiter = UserRateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("alice") for _ in range(3)] == [0.0, 0.0, 0.0]
    with pytest.raises(ClientRateLimitError) as caught:
        limiter.take("alice")
    assert caught.value.status == 429 and caught.value.code == "client_rate_limited"
    assert caught.value.retry_after == pytest.approx(0.5)
    assert limiter.take("bob") == 0.0  # another user has their own bucket
    clock.now += 0.5
    assert limiter.take("alice") == 0.0
    with pytest.raises(ClientRateLimitError):
        limiter.take("alice")
    clock.now += 60
    assert [limiter.take("alice") for _ in range(3)] == [0.0] * 3  # refilled, but never above the burst
    with pytest.raises(ClientRateLimitError):
        limiter.take("alice")


def test_token_bucket_with_max_wait_books_tokens_in_turn():
    clock = Clock()
    limiter = UserRateLimiter.per_minute(60, burst=1, max_wait=2.5, clock=clock)
    assert [limiter.take("alice") for _ in range(3)] == [0.0, pytest.approx(1.0), pytest.approx(2.0)]
    with pytest.raises(ClientRateLimitError) as caught:
        limiter.take("alice")
    assert caught.value.retry_after == pytest.approx(3.0)
    clock.now += 3.0
    assert limiter.take("alice") == 0.0


def test_token_bucket_over_many_users_forgets_the_idle_ones():
    clock = Clock()
    limiter = UserRateLimiter(rate=1.0, burst=2, clock=clock, max_users=100)
    for n in range(100):
        limiter.take(f"user-{n}")
    clock.now += 10
    limiter.take("busy")
    limiter.take("busy")
    assert len(limiter._buckets) <= 2
    with pytest.raises(ClientRateLimitError):
        limiter.take("busy")


def test_token_bucket_holds_across_threads():
    limiter = UserRateLimiter(rate=0.001, burst=5)
    admitted = []

    def hammer() -> None:
        for _ in range(50):
            try:
                limiter.take("alice")
                admitted.append(1)
            except ClientRateLimitError:
                pass

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 5


def test_sync_queue_bounds_waiting_requests_and_concurrency():
    release, running, peak, lock = threading.Event(), [0], [0], threading.Lock()

    def job(n: int):
        def run() -> int:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(10)
            with lock:
                running[0] -= 1
            return n
        return run

    with RequestQueue(max_size=3, concurrency=2) as queue:
        futures = [queue.submit(job(n)) for n in range(2)]
        deadline = time.monotonic() + 5
        while running[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        futures += [queue.submit(job(n)) for n in range(2, 5)]
        assert queue.waiting == 3
        with pytest.raises(QueueFull, match="3 requests already waiting"):
            queue.submit(job(99))
        release.set()
        assert [f.result(10) for f in futures] == [0, 1, 2, 3, 4]
    assert peak[0] == 2 and queue.waiting == 0


def test_a_cancelled_request_gives_its_place_in_the_sync_queue_back():
    """A caller that gives up on a waiting request cancels its future: its place used to stay taken for good, and
    `max_size` cancellations refused every later submit with QueueFull."""
    release = threading.Event()
    with RequestQueue(max_size=2, concurrency=1) as queue:
        busy = queue.submit(lambda: release.wait(10))
        waiting = [queue.submit(lambda: "never run") for _ in range(2)]
        assert all(future.cancel() for future in waiting) and queue.waiting == 0
        later = [queue.submit(lambda n=n: n) for n in range(2)]
        release.set()
        assert busy.result(10) is True and [future.result(10) for future in later] == [0, 1]
    assert queue.waiting == 0


async def test_async_queue_bounds_waiting_requests_and_concurrency():
    release, running, peak = asyncio.Event(), [0], [0]

    def job(n: int):
        async def run() -> int:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            await release.wait()
            running[0] -= 1
            if n == 3:
                raise ValueError("job 3 fails")
            return n
        return run

    async with AsyncRequestQueue(max_size=2, concurrency=2) as queue:
        futures = [queue.submit(job(n)) for n in range(2)]
        for _ in range(3):  # the workers pick up the first two, and start them
            await asyncio.sleep(0)
        assert running[0] == 2
        futures += [queue.submit(job(n)) for n in range(2, 4)]
        assert queue.waiting == 2
        with pytest.raises(QueueFull):
            queue.submit(job(99))
        release.set()
        results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[:3] == [0, 1, 2] and isinstance(results[3], ValueError)
    assert peak[0] == 2


async def test_a_cancelled_request_gives_its_place_in_the_async_queue_back():
    """As in the sync queue: a cancelled waiting request kept its place until a worker came to it, so a queue whose
    workers were busy refused new work for requests nobody wanted any more."""
    release = asyncio.Event()
    async with AsyncRequestQueue(max_size=2, concurrency=1) as queue:
        try:
            busy = queue.submit(release.wait)
            await asyncio.sleep(0)  # the worker picks it up
            waiting = [queue.submit(lambda: asyncio.sleep(0, "never run")) for _ in range(2)]
            assert all(future.cancel() for future in waiting)
            await asyncio.sleep(0)  # a cancelled future's callbacks run in the loop's next round
            assert queue.waiting == 0
            later = [queue.submit(lambda n=n: asyncio.sleep(0, n)) for n in range(2)]
        finally:
            release.set()  # else leaving the block waits for the busy request for good
        assert await busy is True and await asyncio.gather(*later) == [0, 1]
    assert queue.waiting == 0


async def test_a_factory_that_fails_before_awaiting_fails_its_future_only():
    def broken():
        raise ValueError("no call made")

    async with AsyncRequestQueue(max_size=2, concurrency=1) as queue:
        failed, fine = queue.submit(broken), queue.submit(lambda: asyncio.sleep(0, "ran"))
        with pytest.raises(ValueError):
            await failed
        assert await fine == "ran"


def test_rest_error_bodies_of_both_dialects_and_retry_headers():
    body = b'{"error": {"message": "Rate limit reached", "type": "rate_limit_error", "param": null, ' \
           b'"code": "rate_limit_exceeded"}}'
    error = error_from_http(429, body, {"retry-after": "13", "retry-after-ms": "12345"})
    assert isinstance(error, RateLimitError)
    assert (error.status, error.code, error.type, error.param) == (429, "rate_limit_exceeded", "rate_limit_error", None)
    assert error.retry_after == pytest.approx(12.345) and error.should_retry is None
    assert error_from_http(429, body, {"x-should-retry": "false"}).should_retry is False
    anthropic = b'{"type": "error", "error": {"message": "bad", "type": "invalid_request_error", ' \
                b'"param": "max_tokens", "code": "invalid_request"}}'
    error = error_from_http(400, anthropic, {})
    assert isinstance(error, BadRequestError) and error.param == "max_tokens" and error.retry_after is None
    assert isinstance(error_from_http(404, b"", {}), NotFoundError)


def test_rest_errors_without_a_portico_body_still_get_their_row():
    error = error_from_http(503, b"<html>upstream gone</html>", {"retry-after": "2"})
    assert isinstance(error, ServiceUnavailableError)
    assert (error.code, error.type, error.retry_after) == ("service_unavailable", "service_unavailable_error", 2.0)
    assert "upstream gone" in error.message
    dated = error_from_http(500, b"{}", {"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=lambda: 1445412480.0)
    assert isinstance(dated, InternalServerError) and dated.retry_after == pytest.approx(10.0)
    odd = error_from_http(418, b"teapot", {"retry-after": "soon"})  # a status without a row: as INTERNAL (client.md)
    assert type(odd) is InternalServerError and odd.status == 418 and odd.retry_after is None


@pytest.mark.parametrize("make", [
    lambda: PorticoClient.over_grpc("http://127.0.0.1:8080", "pk-x"),  # a URL where gRPC wants host:port
    lambda: AsyncPorticoClient.over_grpc("https://127.0.0.1:8080", "pk-x"),
    lambda: PorticoClient.over_rest("127.0.0.1:8080", "pk-x"),  # no scheme
    lambda: AsyncPorticoClient.over_rest("127.0.0.1:8080", "pk-x"),
    lambda: PorticoClient.over_grpc("127.0.0.1:8080", "pk-x", timeout=0),
    lambda: PorticoClient.over_rest("http://127.0.0.1:8080", "pk-x", timeout=-1),
    lambda: AsyncPorticoClient.over_grpc("127.0.0.1:8080", "pk-x", timeout=0),
])
def test_settings_that_could_never_work_are_refused_when_the_client_is_made(make):
    """Not at the first call, as connection errors retried with backoff (or, for a timeout of 0, every call)."""
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize(("method", "message"), [
    ("StreamChatCompletion", "streams its answer"),  # grpc handed back its raw stream; REST parsed one JSON answer
    ("CreateChatCompletions", "has no method"),  # an AttributeError of the stub over gRPC, a call over REST
])
def test_an_operation_that_is_not_a_unary_rpc_of_its_service_is_refused_when_made(method, message):
    with pytest.raises(ValueError, match=message):
        Operation(ChatServiceStub, method, CreateChatCompletionRequest, ChatCompletionChunk, "POST",
                  "/v1/chat/completions")


def test_the_client_says_it_is_typed():
    """PEP 561: without py.typed, mypy and pyright ignore the client's annotations (its calls are all `Any`)."""
    import importlib.resources
    assert importlib.resources.files("portico.client").joinpath("py.typed").is_file()


def test_the_generated_messages_say_they_are_typed_too():
    """The client returns portico.v1 messages: without py.typed in `portico` (build/gen), mypy ignored their .pyi
    stubs in an installed package, so `completion.model` and every other answer field was `Any`."""
    import importlib.resources
    assert importlib.resources.files("portico").joinpath("py.typed").is_file()


def test_a_clients_repr_never_shows_its_api_key():
    """A client logged with %r (or shown in a traceback's locals) printed `api_key='pk-...'` whole."""
    secret = "pk-dev-" + "s3cret" * 7
    clients = [PorticoClient.over_rest("http://127.0.0.1:9", secret), PorticoClient.over_grpc("127.0.0.1:9", secret),
               AsyncPorticoClient.over_rest("http://127.0.0.1:9", secret),
               AsyncPorticoClient.over_grpc("127.0.0.1:9", secret)]
    for client in clients:
        assert "s3cret" not in repr(client) and "s3cret" not in str(vars(client))
    for client in clients[:2]:
        client.close()
    for client in clients[2:]:
        asyncio.run(client.close())


@pytest.mark.parametrize("body", [{"bogus": 1}, {"messages": [{"role": "user", "content": "x", "nme": "a"}]}])
def test_a_field_the_message_lacks_is_one_line_naming_it(body):
    """protobuf's words ran to a second line ("Available Fields(except extensions): ..."), under a message that had
    already named the field; the gateway's errors are one line."""
    with PorticoClient.over_grpc("127.0.0.1:9", "pk-x") as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat_completion("m", **{"messages": [{"role": "user", "content": "x"}], **body})
    assert "\n" not in str(caught.value) and caught.value.param in ("bogus", "messages[0].nme")


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": {"a set"}}]}, "messages[0].content"),
    ({"stop": {"a"}}, "stop"),
])
@pytest.mark.parametrize("make", [PorticoClient.over_grpc, PorticoClient.over_rest])
def test_a_value_json_cannot_hold_is_named_in_param_on_both_transports(make, fields, param):
    """client.md: such a value is a BadRequestError "naming the field in param where it can"; over REST, where
    json.dumps says only "Object of type set is not JSON serializable", param was None."""
    fields = {"messages": [{"role": "user", "content": "x"}], **fields}
    with make("http://127.0.0.1:9" if make == PorticoClient.over_rest else "127.0.0.1:9", "pk-x") as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat_completion("m", **fields)
    assert caught.value.param == param
