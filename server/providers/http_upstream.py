"""One pooled HTTP client per upstream model server, shared by every model it serves.

Built once at start-up: the base URL, the authentication headers and the timeouts; the keep-alive connection
pools (server/providers/http_client.py) are made on first use, inside the running loop. A request then costs one
POST on a pooled connection, and the connection goes back to the pool once its answer has been read to the end.
Every way the exchange can fail ends as a PorticoError (server/providers/upstream_errors.py): transport errors and
timeouts here, non-2xx answers and mid-stream error events there.

The upstream's `timeouts`: `connect` covers opening a connection (TCP, a proxy's CONNECT, TLS); `read` runs from
the request to the answer's first byte, then between any two bytes of it; `answer` instead bounds an answer that is
not streamed, from the request to its last byte (its first byte comes when all of it is ready, and an upstream that
trickles it in must not hold the caller, whom Envoy would cut off, past it), and a stream until its first event;
`pool` is the wait for one of the `max_connections` slots (a full pool is not an upstream that does not answer).
There is no write timeout: the request is one small buffer, and an upstream that does not take it does not answer
within `read` either.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import TypeVar
from urllib.parse import quote, urlsplit

from server import wire_json
from server.domain_models import UpstreamSpec
from server.errors import PorticoError, ServiceUnavailable, UpstreamError, UpstreamTimeout
from server.observability import UpstreamRecorder
from server.observability.record import Scope
from server.observability.tracing import COUNT_TOKENS, NO_SCOPE, NoScope
from server.providers.http_client import HttpClient, Origin, Pool, header_lines
from server.providers.http_connection import (
    ConnectFailed, ConnectionBroken, ConnectTimeout, Response, TooLarge, TransportError,
)
from server.providers.link_addresses import allowed_classes, link_classes
from server.providers.proxies import env_proxy
from server.providers.transport_errors import TransportErrors
from server.providers.connect_failures import ConnectFailures
from server.providers.upstream_errors import RefusalLog, from_status, from_stream_error
from server.render.sse_decoder import EventTooLarge, SseDecoder, SseEvent

MAX_ERROR_BODY = 64 * 1024  # an error body is read only this far
# A whole answer, or one streamed event, bigger than this is a 502: it could not reach the caller anyway (the
# server's gRPC messages stop at 64 MiB, server/services/images.py MAX_MESSAGE_BYTES), and an upstream that sends
# without end (compressed, 1 MB can decode to 1 GB) must not take the gateway's memory with it.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# Idle pooled connections are dropped after this long: below the 5 s after which uvicorn-based servers (vLLM,
# llama.cpp's Python server) close them, so a connection is not reused just as the server closes it.
KEEPALIVE_SECONDS = 4.0
# A caller that has read the last event it wanted may leave before the end of the body (the chunked encoding's last
# chunk) has arrived. The connection is kept that long for it, in the background, and then goes back to the pool;
# an upstream still sending after it is cut off.
SETTLE_SECONDS = 1.0
SETTLE_BYTES = 64 * 1024

# Sent with every request: no compression (answers are small, and decoding them would cost the loop more than
# the bytes saved on a local network; gzip or deflate sent all the same is decoded); a name for the upstream's logs.
_COMMON_HEADERS = {"accept": "*/*", "accept-encoding": "identity", "user-agent": "portico"}
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # RFC 3986's pchar and "/", and "%" for escapes already made
_QUERY_SAFE = _PATH_SAFE + "?"
# gen_ai.operation.name by path (tracing.OPERATIONS); the others are "chat"
_OPERATIONS = {"images/generations": "generate_content", "v1/messages/count_tokens": COUNT_TOKENS}

# A UTF-8 byte order mark before a JSON answer (some Windows and .NET servers write one), which the SDKs skip:
# Python's json.loads of bytes and JavaScript's fetch().json() both read past it.
_BOM = b"\xef\xbb\xbf"

T = TypeVar("T")
_logger = logging.getLogger(__name__)

# What a server answers for a path it does not serve: not found, the method not allowed there, not implemented.
_UNSERVED = frozenset({404, 405, 501})


class PathUnserved(Exception):
    """The upstream has no such path (its 404, 405 or 501 where a caller of `post_json` allowed for it): no
    failure of the upstream nor of the gateway's configuration, so neither logged nor judged as one. `first`: the
    first time this upstream answered so for the path, in this process."""

    def __init__(self, status: int, *, first: bool) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.first = first


class HttpUpstream:
    def __init__(self, spec: UpstreamSpec, *, auth_headers: Mapping[str, str], secret: str | None,
                 provider: str = "openai", recorder: UpstreamRecorder | None = None,
                 outlast: Callable[[], bool] | None = None) -> None:
        """`provider`: the dialect the server speaks ("openai" or "anthropic"); `recorder` opens a traced request's
        span for each POST (server/observability); `outlast` says whether a generation whose caller left runs on
        (server/cutoff.py Cutoff.outlast; None: never)."""
        timeouts = spec.timeouts
        self._base = spec.base_url + "/"
        self._provider = provider
        self._recorder = recorder
        self._origin = Origin.of(self._base)
        self._address, self._port = self._origin.host, self._origin.port
        self._base_path = urlsplit(self._base).path
        self._connect_timeout = timeouts.connect
        self._read_timeout = timeouts.read
        self._answer_timeout = timeouts.answer  # a non-streamed answer's first byte comes when all of it is ready
        self._pool_timeout = timeouts.pool
        self._transport_errors = TransportErrors()
        self._connect_failures = ConnectFailures()
        self._refusals = RefusalLog()
        # Held from the request until its connection is back in the pool or closed.
        self._slots = asyncio.Semaphore(spec.max_connections)
        # Sent per request, so that fetching an image from a link the upstream gave (often another host) never
        # carries the key.
        own = {"content-type": "application/json", **_COMMON_HEADERS, **{k.lower(): v for k, v in auth_headers.items()}}
        self._own_names = frozenset(own)
        self._headers = header_lines(own.items())
        self._fetch_headers = header_lines(_COMMON_HEADERS.items())
        self._secret = secret
        self._retry_on = frozenset(spec.retry.on_status)
        self._proxy = env_proxy(self._base)
        self._client: HttpClient | None = None
        self._pool: Pool | None = None
        self._closed = False
        self._settling: set[asyncio.Task] = set()
        self._outlast = outlast
        self._link_classes: frozenset[str] | None = None  # where links may lead: known at the first link fetched
        self._unserved: set[str] = set()  # paths the upstream said it has not (PathUnserved)

    async def close(self) -> None:
        self._closed = True
        for task in self._settling:
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self._client is not None:
            self._client.close()
            self._client = self._pool = None

    @asynccontextmanager
    async def stream(self, path: str, body: Mapping, *, model_id: str, headers: Mapping[str, str] | None = None,
                     attempt: Scope | NoScope = NO_SCOPE) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """POST `body` and yield the answer's server-sent events. Leaving the block before the end of the answer
        with an exception (an error, a caller who went away) closes the connection, which is how the upstream's
        work is cancelled; leaving it normally after the last event the caller wanted lets the connection go back
        to the pool once the answer is complete. `attempt`: the caller's span for it (`attempt()`), which the caller
        ends once it has read the answer (every provider traces its exchanges so)."""
        # The first event must come within `answer` too: a stream kept open by comments alone (a proxy's while its
        # model thinks) restarts the read timeout with each, and would otherwise run until Envoy cut it.
        response = await self._send(self._base_pool(), "POST", self._base_path + path, model_id,
                                    before_answer=True, body=wire_json.dumps(body),
                                    headers=self._headers_for(attempt, headers), read_timeout=self._read_timeout,
                                    answer_within=self._answer_timeout)
        attempt.set("http.response.status_code", response.status)
        events = None
        try:
            if response.status >= 300:
                raise await self._status_error(response, model_id, body.get("model"))
            self._refusals.answered(model_id)
            if _not_a_stream(response.content_type):
                # A whole answer (a server that ignores `stream`, a proxy's page): never retried, the upstream
                # has answered, and may have billed it. Unless it is an error object, which is that error.
                raise await self._not_a_stream_error(response, model_id, body.get("model"))
            events = self._events(response, model_id, body.get("model"))
            yield events
        except BaseException:
            self._give_back(response, caller_done=False)
            raise
        else:
            self._give_back(response, caller_done=True)
        finally:
            if events is not None:
                await events.aclose()

    async def post_json(self, path: str, body: Mapping, *, model_id: str, headers: Mapping[str, str] | None = None,
                        billed: bool = False, cut_retried: bool = True, optional: bool = False,
                        attempt: Scope | NoScope = NO_SCOPE) -> dict:
        """`billed`: a generation, which the upstream finishes and bills even when its client leaves: once sent, a
        caller who leaves does not end it (server/cutoff.py), and it is read to its end within its timeouts.
        `cut_retried`: an answer whose connection breaks after it began may be asked for again (a text answer);
        False for images, which each try would draw and bill again. `optional`: a path some servers of the dialect
        lack, whose 404, 405 or 501 is PathUnserved. `attempt`: as for `stream`."""
        try:
            response = await self._send(self._base_pool(), "POST", self._base_path + path, model_id,
                                        before_answer=True, body=wire_json.dumps(body),
                                        headers=self._headers_for(attempt, headers), read_timeout=self._answer_timeout,
                                        answer_within=self._answer_timeout, outlast=self._outlast if billed else None)
        except UpstreamTimeout as error:
            # Sent whole, then no answer in time (a connect timeout sent nothing: retryable): an images API answers
            # once its images are drawn, so it was drawing, and bills them, as for an answer too slow to arrive whole.
            raise (error if error.retryable else _answer_unread(error, cut_retried)) from None
        attempt.set("http.response.status_code", response.status)
        try:
            if optional and response.status in _UNSERVED:
                await _error_body(response)  # read, so that the connection goes back to the pool
                first = path not in self._unserved
                self._unserved.add(path)
                raise PathUnserved(response.status, first=first)
            if response.status >= 300:
                raise await self._status_error(response, model_id, body.get("model"))
            self._refusals.answered(model_id)
            try:
                content = await response.read(MAX_ANSWER_BYTES)
            except TransportError as exc:
                error = self._transport_errors.of(exc, model_id, before_answer=True)
                raise _answer_unread(error, cut_retried) from None
        finally:
            self._give_back(response, caller_done=False)
        try:
            data = wire_json.loads(content.removeprefix(_BOM))
        except wire_json.JSONDecodeError:
            # A proxy's maintenance or login page says so by its type: named, so nobody looks for a JSON fault.
            stated = response.content_type
            what = "invalid JSON" if not stated or "json" in stated else f"{stated[:100]}, not JSON"
            raise _answer_unread(UpstreamError(f"The upstream serving `{model_id}` answered with {what}."),
                                 cut_retried) from None
        if not isinstance(data, dict):
            raise _answer_unread(UpstreamError(f"The upstream serving `{model_id}` answered with unexpected JSON."),
                                 cut_retried)
        return data

    async def billed(self, work: Awaitable[T]) -> T:
        """`work` that finishes a billed answer (fetching the images it links): a caller who leaves meanwhile does not
        end it (as in `post_json(billed=True)`), so that what the upstream drew and billed is counted."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._outlast is None or not self._outlast():
                task.cancel()
                raise
        return await task

    async def fetch(self, url: str, *, model_id: str, media_type: str) -> bytes:
        """GET a link from an upstream's answer (an image URL: `media_type` "image"), without credentials. An answer
        whose content-type names another type (an HTML error page, say) is an UpstreamError naming it; one without
        a content-type is read, for the caller to judge. No failure here is retried: the upstream has answered, so it
        drew and billed what the link names, and asking it again would draw and bill that again."""
        try:
            parts = urlsplit(url)
            if parts.scheme:
                link = url
            elif parts.netloc:  # `//host/path` names its host, keeping the base URL's scheme (RFC 3986)
                link = f"{urlsplit(self._base).scheme}:{url}"
            else:  # relative: to the base URL, as before
                link = self._base + url.lstrip("/")
            origin, parts = Origin.of(link), urlsplit(link)
        except ValueError:
            raise UpstreamError(f"The upstream serving `{model_id}` sent a link that is not a URL.") from None
        # Spaces and other characters a request line cannot hold are escaped; escapes already there stay as they are.
        path = quote(parts.path or "/", safe=_PATH_SAFE) + (f"?{quote(parts.query, safe=_QUERY_SAFE)}"
                                                             if parts.query else "")
        if origin == self._origin:  # on the upstream itself: fetched as it is asked
            pool = self._base_pool()
        else:  # elsewhere: only where links may lead (server/providers/link_addresses.py)
            pool = self._client_now().pool(origin, env_proxy(link), await self._allowed_for_links())
        try:
            response = await self._send(pool, "GET", path, model_id, before_answer=False, body=b"",
                                        headers=self._fetch_headers, read_timeout=self._read_timeout)
        except PorticoError as error:
            raise _not_retried(error) from None
        try:
            if response.status >= 300:
                raise UpstreamError(f"Fetching a result of `{model_id}` failed with HTTP {response.status}.")
            stated = response.content_type  # the media type alone, lower case
            if "content-type" in response.headers and stated.partition("/")[0] != media_type:
                raise UpstreamError(f"Fetching a result of `{model_id}` gave {stated[:100]}, not {media_type}/*.")
            try:
                return await response.read(MAX_ANSWER_BYTES)
            except TransportError as exc:
                raise _not_retried(self._transport_errors.of(exc, model_id, before_answer=False)) from None
        finally:
            self._give_back(response, caller_done=False)

    def event_object(self, data: bytes, model_id: str) -> dict:
        """A streamed event's data as the JSON object both dialects send, or an UpstreamError."""
        try:
            payload = wire_json.loads(data)
        except wire_json.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            raise UpstreamError(f"The upstream serving `{model_id}` sent an event that is not a JSON object.")
        return payload

    def stream_error(self, payload: Mapping, model_id: str, upstream_model: str | None = None) -> PorticoError:
        return from_stream_error(payload, retry_on=self._retry_on, upstream=model_id, secret=self._secret,
                                 upstream_model=upstream_model)

    def attempt(self, path: str, body: Mapping, model_id: str) -> Scope | NoScope:
        """The span of one request to this upstream, for a caller that reads the answer itself to say on it what
        the upstream answered (Scope.answered): `with` around `stream` or `post_json` given it and that reading."""
        if self._recorder is None:
            return NO_SCOPE
        upstream_model = body.get("model")
        return self._recorder.attempt(model_id, upstream_model if isinstance(upstream_model, str) else "",
                                      self._provider, _OPERATIONS.get(path, "chat"), self._address, self._port)

    def _headers_for(self, attempt: Scope | NoScope, extra: Mapping[str, str] | None = None) -> bytes:
        """The request's header lines: the upstream's own, plus a request's `extra` (e.g. `anthropic-beta`, which
        cannot replace them); for a traced request with its `traceparent` (and `tracestate`), so the upstream's own
        spans join the trace."""
        if attempt is NO_SCOPE and not extra:
            return self._headers
        fields = {name.lower(): value for name, value in (extra or {}).items() if name.lower() not in self._own_names}
        if attempt is not NO_SCOPE:
            fields.update(attempt.headers())
        return self._headers + header_lines(fields.items())

    def _client_now(self) -> HttpClient:
        client = self._client
        if client is None:
            if self._closed:
                raise RuntimeError("the upstream's HTTP client has been closed")
            client = self._client = HttpClient(ssl_context=_ssl_context, connect_timeout=self._connect_timeout,
                                               keepalive=KEEPALIVE_SECONDS)
        return client

    async def _allowed_for_links(self) -> frozenset[str]:
        """The address classes links may lead to: public ones, and the classes the base URL's host resolves to."""
        if self._link_classes is None:
            classes = await link_classes(self._address, self._port, self._connect_timeout)
            if classes is None:  # not known here: public links only, until it is
                return allowed_classes(frozenset())
            self._link_classes = classes
        return self._link_classes

    def _base_pool(self) -> Pool:
        pool = self._pool
        if pool is None:
            pool = self._pool = self._client_now().pool(self._origin, self._proxy)
        return pool

    async def _send(self, pool: Pool, method: str, path: str, model_id: str, *, before_answer: bool, body: bytes,
                    headers: bytes, read_timeout: float | None, answer_within: float | None = None,
                    outlast: Callable[[], bool] | None = None) -> Response:
        """The response (status and headers read) on a pooled connection. It holds one of the pool's slots until
        `_give_back`, which every caller must reach."""
        slots = self._slots
        if slots.locked():
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await slots.acquire()
            except TimeoutError:
                raise ServiceUnavailable(f"Every connection to the upstream serving `{model_id}` is busy.",
                                         retry_reason="other") from None
        else:
            await slots.acquire()  # immediate
        try:
            return await pool.request(method, path, headers=headers, body=body, read_timeout=read_timeout,
                                      answer_within=answer_within, outlast=outlast)
        except BaseException as exc:
            slots.release()
            if isinstance(exc, TransportError):
                if isinstance(exc, (ConnectFailed, ConnectTimeout)):
                    self._connect_failures.note(f"{pool.origin.scheme}://{pool.origin.authority}", model_id, exc)
                raise self._transport_errors.of(exc, model_id, before_answer=before_answer) from None
            raise

    def _give_back(self, response: Response, *, caller_done: bool) -> None:
        """A complete answer's connection goes back to the pool. An unfinished one is closed (the upstream stops
        generating), unless the caller left normally: then its end may still be on the way (`_settle`)."""
        if response.is_eof():
            response.release()
        elif caller_done:
            task = asyncio.get_running_loop().create_task(self._settle(response))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            return
        else:
            response.close()
        self._slots.release()

    async def _settle(self, response: Response) -> None:
        try:
            async with asyncio.timeout(SETTLE_SECONDS):
                left = SETTLE_BYTES
                while left > 0 and (chunk := await response.readany()):
                    left -= len(chunk)
        except (TransportError, TimeoutError):
            pass
        finally:
            self._give_back(response, caller_done=False)

    async def _events(self, response: Response, model_id: str, upstream_model: str | None) -> AsyncIterator[SseEvent]:
        """The answer's events, decoded as its bytes arrive."""
        decoder = SseDecoder(MAX_ANSWER_BYTES)
        began = False
        start = bytearray()  # the body's first bytes while no event has come: maybe an error object instead
        try:
            while chunk := await response.readany():
                if events := decoder.feed(chunk):
                    began = True
                    response.lift_deadline()  # the stream has begun: the read timeout alone bounds the rest
                elif not began and len(start) < MAX_ERROR_BODY:
                    start += chunk
                for event in events:
                    yield event
        except TransportError as exc:
            raise self._transport_errors.of(exc, model_id, before_answer=False) from None
        except EventTooLarge:
            raise self._transport_errors.of(TooLarge(f"sent an event of more than {MAX_ANSWER_BYTES >> 20} MiB"),
                                        model_id, before_answer=False) from None
        for event in decoder.end():  # the last event, without its blank line: whole, or the half of one
            if event.data != b"[DONE]" and not wire_json.is_json(event.data):
                # The body ended cleanly (closed, or a proxy's last chunk) inside an event: the stream broke off,
                # which is retried while no content has reached the caller, not "an event that is not JSON".
                raise self._transport_errors.of(ConnectionBroken("the stream ended in the middle of an event"),
                                                model_id, before_answer=False)
            began = True
            yield event
        if not began:
            # Some OpenAI-compatible servers answer a failure as their JSON error object, with status 200 and an
            # event stream's content-type: that error (a prompt too long is a 400), not a stream cut short.
            try:
                payload = wire_json.loads(bytes(start).removeprefix(_BOM).strip())
            except wire_json.JSONDecodeError:
                payload = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), Mapping):
                raise self.stream_error(payload, model_id, upstream_model)

    async def _status_error(self, response: Response, model_id: str, upstream_model: str | None) -> PorticoError:
        return from_status(response.status, await _error_body(response), response.headers, retry_on=self._retry_on,
                           upstream=model_id, secret=self._secret, upstream_model=upstream_model,
                           refusals=self._refusals)

    async def _not_a_stream_error(self, response: Response, model_id: str,
                                  upstream_model: str | None) -> PorticoError:
        """A 2xx answer to a streamed request that is no stream. An error object (some OpenAI-compatible servers
        answer a failure so, with status 200) is that error; anything else says what came back."""
        if response.content_type != "text/html":
            try:
                payload = wire_json.loads(await _error_body(response))
            except wire_json.JSONDecodeError:
                payload = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), Mapping):
                return self.stream_error(payload, model_id, upstream_model)
        return UpstreamError(f"The upstream serving `{model_id}` answered a streamed request with "
                             f"{response.content_type[:100]}, not an event stream.")


def _not_retried(error: PorticoError, *, unread: bool = False) -> PorticoError:
    """`error`, met after a billed answer began (reading it, fetching what it links to), with its status and message
    but never retried, by the gateway nor by its caller (`x-should-retry: false`: the SDKs retry a 502 twice by
    default): the upstream has drawn and billed what it answered, and would draw and bill it again. `unread`: the
    answer itself could not be read (PorticoError.answer_unread)."""
    error.retry_reason = None
    error.should_retry = False
    error.answer_unread = unread
    return error


def _answer_unread(error: PorticoError, cut_retried: bool) -> PorticoError:
    """`error` for an answer that could not be read (cut off, not JSON, not there in time): as it is where asking
    again may serve (`cut_retried`), else never retried, the work done and billed (PorticoError.answer_unread)."""
    return error if cut_retried else _not_retried(error, unread=True)


async def _error_body(response: Response) -> bytes:
    """The start of an answer that is no stream (an error's body), up to MAX_ERROR_BODY."""
    parts: list[bytes] = []
    size = 0
    try:
        while size < MAX_ERROR_BODY and (chunk := await response.readany()):
            parts.append(chunk)
            size += len(chunk)
    except TransportError:
        pass  # what arrived is kept: a body cut at its end still names the upstream's reason
    return b"".join(parts)[:MAX_ERROR_BODY].removeprefix(_BOM)


def _not_a_stream(content_type: str) -> bool:
    """Media types no server streams events in. Others (none, text/plain, ...) are read as events: some servers
    label their streams loosely."""
    return content_type in ("application/json", "text/html") or content_type.endswith("+json")


def _ssl_context() -> ssl.SSLContext:
    """The system's CAs and certifi's, which httpx used: a slim image without a CA store still reaches HTTPS
    upstreams."""
    context = ssl.create_default_context()
    with suppress(ImportError):
        import certifi

        context.load_verify_locations(certifi.where())
    return context
