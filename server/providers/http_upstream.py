"""One pooled HTTP client per upstream model server, shared by every model it serves.

Built once at start-up: the httpx.AsyncClient (keep-alive pool, timeouts), the base URL and the authentication
headers. A request then costs one POST on a pooled connection. Every way the exchange can fail ends as a
PorticoError (server/providers/upstream_errors.py): transport errors and timeouts here, non-2xx answers and
mid-stream error events there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import orjson

from server.config_providers import UpstreamSpec
from server.errors import PorticoError, ServiceUnavailable, UpstreamError, UpstreamTimeout
from server.providers.upstream_errors import from_status, from_stream_error

MAX_ERROR_BODY = 64 * 1024  # an error body is read only this far


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" when the upstream sent no `event:` line
    data: str


class HttpUpstream:
    def __init__(self, spec: UpstreamSpec, *, auth_headers: Mapping[str, str], secret: str | None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        timeouts = spec.timeouts
        self._client = httpx.AsyncClient(
            base_url=spec.base_url + "/",
            timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.read, write=timeouts.write,
                                  pool=timeouts.pool),
            limits=httpx.Limits(max_connections=spec.max_connections,
                                max_keepalive_connections=spec.max_connections),
            transport=transport,
        )
        # Sent per request, not as client defaults, so that fetching an image from a link the upstream gave (often
        # another host) never carries the key.
        self._headers = {"content-type": "application/json", **auth_headers}
        self._secret = secret
        self._retry_on = frozenset(spec.retry.on_status)

    async def close(self) -> None:
        await self._client.aclose()

    @asynccontextmanager
    async def stream(self, path: str, body: Mapping, *, model_id: str) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """POST `body` and yield the answer's server-sent events. Leaving the block early closes the connection,
        which is how a caller who went away cancels the upstream's work."""
        request = self._client.build_request("POST", path, content=orjson.dumps(body), headers=self._headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, model_id, before_answer=True) from None
        try:
            if response.status_code >= 300:
                raise await self._status_error(response, model_id)
            yield self._events(response, model_id)
        finally:
            await response.aclose()

    async def post_json(self, path: str, body: Mapping, *, model_id: str) -> dict:
        try:
            response = await self._client.post(path, content=orjson.dumps(body), headers=self._headers)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, model_id, before_answer=True) from None
        if response.status_code >= 300:
            raise await self._status_error(response, model_id)
        try:
            data = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"The upstream serving `{model_id}` answered with invalid JSON.") from None
        if not isinstance(data, dict):
            raise UpstreamError(f"The upstream serving `{model_id}` answered with unexpected JSON.")
        return data

    async def fetch(self, url: str, *, model_id: str) -> bytes:
        """GET a link from an upstream's answer (an image URL), without credentials."""
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, model_id, before_answer=False) from None
        if response.status_code >= 300:
            raise UpstreamError(f"Fetching a result of `{model_id}` failed with HTTP {response.status_code}.")
        return response.content

    def stream_error(self, payload: Mapping, model_id: str) -> PorticoError:
        return from_stream_error(payload, retry_on=self._retry_on, upstream=model_id, secret=self._secret)

    async def _events(self, response: httpx.Response, model_id: str) -> AsyncIterator[SseEvent]:
        """Parse text/event-stream lines into events (https://html.spec.whatwg.org/#event-stream-interpretation)."""
        event, data = "", []
        try:
            async for line in response.aiter_lines():
                if not line:
                    if data:
                        yield SseEvent(event or "message", "\n".join(data))
                    event, data = "", []
                elif line.startswith("data:"):
                    data.append(line[6:] if line.startswith("data: ") else line[5:])
                elif line.startswith("event:"):
                    event = line[6:].strip()
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, model_id, before_answer=False) from None
        if data:  # a last event without its blank line
            yield SseEvent(event or "message", "\n".join(data))

    async def _status_error(self, response: httpx.Response, model_id: str) -> PorticoError:
        body = b""
        try:
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) >= MAX_ERROR_BODY:
                    break
        except httpx.HTTPError:
            pass  # the status says enough
        return from_status(response.status_code, body, response.headers, retry_on=self._retry_on,
                           upstream=model_id, secret=self._secret)

    def _transport_error(self, exc: httpx.HTTPError, model_id: str, *, before_answer: bool) -> PorticoError:
        """Connection failures before an answer may be retried; a read timeout is not (the upstream may still be
        working on the request, and retrying would pay for it twice)."""
        name = f"`{model_id}`"
        if isinstance(exc, httpx.ConnectTimeout):
            return UpstreamTimeout(f"Connecting to the upstream serving {name} timed out.", retry_reason="timeout")
        if isinstance(exc, httpx.PoolTimeout):
            return ServiceUnavailable(f"Every connection to the upstream serving {name} is busy.",
                                      retry_reason="other")
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"The upstream serving {name} did not answer in time.")
        if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            if before_answer and isinstance(exc, httpx.ConnectError):
                return ServiceUnavailable(f"Cannot connect to the upstream serving {name}.", retry_reason="connect")
            # A broken connection: retried only if nothing reached the caller yet (server/providers/retry.py).
            return UpstreamError(f"The connection to the upstream serving {name} broke off.", retry_reason="connect")
        return UpstreamError(f"The request to the upstream serving {name} failed: {type(exc).__name__}.")
