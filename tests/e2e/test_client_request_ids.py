"""portico.client and request ids against the real gateway, over gRPC and REST, sync and asyncio: a caller's own
`x-request-id` (to trace a call across services) is sent and logged as given, a success's id can be read, and an
id the gateway would not keep as given is refused before anything is sent."""

from __future__ import annotations

import pytest

from portico.client import (
    CHAT_COMPLETION, AsyncPorticoClient, NotFoundError, PorticoClient, PorticoClientError, RetryPolicy,
)
from portico.v1 import chat_pb2
from tests.e2e.test_operations import wait_for_line


HI = [{"role": "user", "content": "Hi"}]


def clients(gateway, transport: str, **options) -> tuple[PorticoClient, AsyncPorticoClient]:
    if transport == "grpc":
        target = f"127.0.0.1:{gateway.port}"
        return (PorticoClient.over_grpc(target, gateway.secret, **options),
                AsyncPorticoClient.over_grpc(target, gateway.secret, **options))
    return (PorticoClient.over_rest(gateway.base_url, gateway.secret, **options),
            AsyncPorticoClient.over_rest(gateway.base_url, gateway.secret, **options))


@pytest.mark.parametrize("transport", ["grpc", "rest"])
async def test_a_success_gives_the_id_the_gateway_logged_it_under(gateway, transport):
    """Errors carried their request id; a success's could not be read at all, on either transport."""
    client, aclient = clients(gateway, transport)
    body = {"messages": HI, "max_tokens": 1}
    with client:
        reply = client.call_with_id(CHAT_COMPLETION, body, model="family-a-5.5")
    async with aclient:
        areply = await aclient.call_with_id(CHAT_COMPLETION, body, model="family-a-5.5")
    for each in (reply, areply):
        assert isinstance(each.message, chat_pb2.ChatCompletion) and each.message.model == "family-a-5.5"
        line = wait_for_line(gateway, each.request_id)
        assert (line["status"], line["model"]) == (200, "family-a-5.5")
    assert reply.request_id != areply.request_id


@pytest.mark.parametrize("transport", ["grpc", "rest"])
async def test_a_callers_own_request_id_is_sent_and_logged_as_given(gateway, transport):
    """A caller tracing a call across services could not send its own x-request-id: `request_id=` went into the
    request body as an unknown field (refused over gRPC, a 400 over REST)."""
    client, aclient = clients(gateway, transport)
    mine = f"checkout-7f3a/{transport}/"
    with client:
        completion = client.chat_completion("family-a-5.5", HI, max_tokens=1, request_id=mine + "1")
        assert completion.model == "family-a-5.5"
        reply = client.call_with_id(CHAT_COMPLETION, {"messages": HI, "max_tokens": 1}, model="family-a-5.5",
                                    request_id=mine + "2")
        with pytest.raises(NotFoundError) as missing:
            client.message("family-b-0.1", HI, max_tokens=1, request_id=mine + "3")
    async with aclient:
        count = await aclient.count_message_tokens("family-b-haiku-4-5-20251001", HI, request_id=mine + "4")
        assert count.input_tokens > 0
        await aclient.list_models(request_id=mine + "5")
    assert (reply.request_id, missing.value.request_id) == (mine + "2", mine + "3")
    for n in "12345":
        wait_for_line(gateway, mine + n)


@pytest.mark.parametrize("transport", ["grpc", "rest"])
@pytest.mark.parametrize("bad", ["x" * 129, "", "two words", "caf\u00e9", "line\nbreak", "trace-pk-abc123"])
async def test_an_id_the_gateway_would_not_keep_as_given_is_refused_before_sending(transport, bad):
    """Over 128 bytes (cut), a key's shape (redacted), not printable ASCII (changed, or not sendable as gRPC
    metadata or an HTTP header at all): refused at once, nothing sent (here, to a port where nothing listens)."""
    options = {"retry": RetryPolicy(attempts=1), "timeout": 2}
    target = "127.0.0.1:9" if transport == "grpc" else "http://127.0.0.1:9"
    make = PorticoClient.over_grpc if transport == "grpc" else PorticoClient.over_rest
    with make(target, "pk-test", **options) as client:
        with pytest.raises(ValueError, match="request_id"):
            client.chat_completion("family-a-5.5", HI, max_tokens=1, request_id=bad)
        with pytest.raises(PorticoClientError):
            client.chat_completion("family-a-5.5", HI, max_tokens=1, request_id="fine")  # it was the id


@pytest.mark.parametrize("transport", ["grpc", "rest"])
def test_an_id_with_a_percent_escape_beside_pk_is_logged_as_given(gateway, transport):
    """An id that holds `pk-` went through Envoy's cut (the Lua filter), which percent-decoded it as it decodes a
    URL's path before looking for a key there: `job-pk-%7E1`, nothing like a key and accepted by the client,
    came back and was logged as `job-pk-~1`, and `job-pk-%41b` as `job-pk-[redacted]`, so the caller found no line
    under its own id. A key is looked for in the id as sent (api.md); the server's redaction reads it so too."""
    client, _ = clients(gateway, transport)
    ids = [f"job-pk-%7E1/{transport}", f"job-pk-%41b/{transport}"]
    with client:
        replies = [client.call_with_id(CHAT_COMPLETION, {"messages": HI, "max_tokens": 1}, model="family-a-5.5",
                                       request_id=mine) for mine in ids]
    assert [reply.request_id for reply in replies] == ids
    for mine in ids:
        wait_for_line(gateway, mine)
