"""A model served by an Anthropic Messages upstream (api.anthropic.com, or a server speaking its API).

As with OpenAI-compatible upstreams, the upstream is asked the way the caller asked: a stream reaches the caller
event by event, and the usage in message_start / message_delta settles the limits; a caller that does not stream
gets the upstream's one `message`, turned into the same events (server/translate/anthropic_events_to_internal.py
`message_events`), whose usage settles them. Each upstream object (the message, or each event) is yielded as it came,
before its events, for callers of the same dialect.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from server.domain import AnthropicMessagesSource, Dialect, GenerationRequest
from server.domain_answers import GenerationEvent, TokenCount, UpstreamAnswer, UpstreamObject, random_call_ids
from server.domain_models import UpstreamSpec
from server.errors import InvalidRequest, PorticoError, UpstreamError, UpstreamMisconfigured
from server.providers import Capabilities
from server.providers.http_upstream import HttpUpstream, PathUnserved
from server.providers.upstream_errors import scrubbed_object
from server.translate.anthropic_events_to_internal import (
    AnthropicEventReader, anthropic_answer, carries_content, message_events,
)
from server.translate.internal_to_anthropic_request import anthropic_body, caller_param, count_body
from server.translate.usage_counts import token_count

_logger = logging.getLogger(__name__)

ANTHROPIC_VERSION = "2023-06-01"  # the Messages API version every current Anthropic model speaks


def anthropic_auth_headers(api_key: str | None) -> dict[str, str]:
    return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": api_key} if api_key else {})}


def _beta_headers(request: GenerationRequest) -> dict[str, str] | None:
    """The caller's `anthropic-beta` values, which the beta fields of its body need (a Messages caller only)."""
    source = request.source
    if isinstance(source, AnthropicMessagesSource) and source.beta:
        return {"anthropic-beta": ",".join(source.beta)}
    return None


class AnthropicProvider:
    capabilities = Capabilities(tool_calls=True, json_output=True, dialects=frozenset({Dialect.ANTHROPIC}))

    def __init__(self, upstream: HttpUpstream, spec: UpstreamSpec, *, model_id: str) -> None:
        self._upstream = upstream
        self._model = spec.model
        self._model_id = model_id  # ours, for messages
        self._call_ids = random_call_ids("toolu_")  # for a compatible server's tool_use blocks without an id

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        body = anthropic_body(request, model=self._model)
        headers = _beta_headers(request)
        # The attempt's span is ours until the answer is read: it says what the upstream answered, or failed.
        attempt = self._upstream.attempt("v1/messages", body, self._model_id)
        try:
            if not request.stream:
                with attempt:
                    answer = await self._upstream.post_json("v1/messages", body, model_id=self._model_id,
                                                            headers=headers, billed=True, attempt=attempt)
                    if answer.get("type") == "error" or answer.get("error"):
                        raise self._upstream.stream_error(answer, self._model_id, self._model)
                    generated = message_events(answer, prompt_estimate=request.estimated_prompt_tokens(),
                                               call_ids=self._call_ids)
                    if attempt.recording:
                        attempt.answered(anthropic_answer(answer))
                yield UpstreamObject(Dialect.ANTHROPIC, answer)
                for event in generated:
                    yield event
                return
            reader = AnthropicEventReader(prompt_estimate=request.estimated_prompt_tokens(), call_ids=self._call_ids,
                                          thoughts=not isinstance(request.source, AnthropicMessagesSource))
            try:
                with attempt:
                    async with self._upstream.stream("v1/messages", body, model_id=self._model_id, headers=headers,
                                                     attempt=attempt) as events:
                        async for event in events:
                            payload = self._upstream.event_object(event.data, self._model_id)
                            if event.event == "error" or payload.get("type") == "error":
                                raise self._upstream.stream_error(payload, self._model_id, self._model)
                            made = reader.feed(payload)  # first: an event not the API's never reaches the caller
                            if attempt.recording:
                                attempt.answered(anthropic_answer(payload))
                            yield UpstreamObject(Dialect.ANTHROPIC, payload, carries_content(payload))
                            for generated in made:
                                yield generated
                            if reader.finished:
                                return
                    reader.end()  # a stream cut short fails its attempt
            except PorticoError as error:  # broken off after message_delta: settled with the count it reported
                error.usage_reported = error.usage_reported or reader.reported()
                raise
        except InvalidRequest as error:  # Anthropic names no param; its message names a field of the body built here
            if error.param is None:
                error.param = caller_param(request, error.message)
            raise

    async def count_prompt(self, request: GenerationRequest) -> TokenCount:
        """The upstream's own count (its /v1/messages/count_tokens), asked as a message is: the upstream's model
        name, the caller's `anthropic-beta` values. Its answer reaches the caller whole, with our model id for its."""
        body = count_body(request, model=self._model)
        # The attempt's span is ours until the answer is read: it says what the upstream counted, or failed.
        attempt = self._upstream.attempt("v1/messages/count_tokens", body, self._model_id)
        with attempt:
            try:
                answer = await self._upstream.post_json("v1/messages/count_tokens", body, model_id=self._model_id,
                                                        headers=_beta_headers(request), optional=True,
                                                        attempt=attempt)
            except PathUnserved as unserved:
                # Many Anthropic-compatible servers serve /v1/messages but no count_tokens: counted as an
                # OpenAI-compatible upstream's prompts are (SDK callers count often, and broke on a 502). Asked
                # each time: one that gains the endpoint counts itself at once.
                if unserved.first:
                    _logger.warning("The upstream serving %s has no count_tokens endpoint (HTTP %d): counts for its "
                                    "models are estimated.", self._model_id, unserved.status)
                attempt.set("portico.count_estimated", True)  # else its span says only the 404
                return TokenCount(request.estimated_prompt_tokens())
            except UpstreamMisconfigured as error:
                # A refused key or account (401, 403, 402) must not take the deployment out for its messages, which
                # judge a configuration that is really wrong.
                error.judges_deployment = False
                raise
            if answer.get("type") == "error" or answer.get("error"):
                raise self._upstream.stream_error(answer, self._model_id, self._model)
            # Not the API's answer (null too: it is the whole answer here, where a message's usage may leave a count
            # unreported); asking again would get the same.
            if answer.get("input_tokens") is None:
                raise UpstreamError(
                    f"The upstream serving `{self._model_id}` answered a token count without input_tokens.")
            counted = token_count(answer, "input_tokens")
            if attempt.recording:  # a count has no id, model or output: only its input tokens
                attempt.answered(UpstreamAnswer(input_tokens=counted))
        return TokenCount(counted, scrubbed_object(answer, self._model, self._model_id))

    async def close(self) -> None:
        """Closes the pooled client, which other models may share: closing it twice is harmless."""
        await self._upstream.close()
