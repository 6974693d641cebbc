"""A model served by an OpenAI-compatible HTTP server (OpenAI, vLLM, TGI, llama.cpp's server, Ollama, ...).

The upstream is asked the way the caller asked. A caller that streams gets the upstream's stream, with usage,
event by event. One that does not gets the upstream's one JSON answer (a chat.completion, which carries usage),
turned into the same events (server/translate/openai_chunks_to_internal.py `completion_events`) and collected by
the pipeline: retries, fallbacks and the limits see no difference, and the upstream sends one body instead of a
chunk per token. Either way, every answer settles the limits with the upstream's own counts, and each upstream
object (the answer, or each chunk) is yielded as it came, before its events, for callers of the same dialect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from server.domain import Dialect, GenerationRequest
from server.domain_answers import GenerationEvent, Started, UpstreamObject, random_call_ids
from server.domain_models import UpstreamSpec
from server.errors import InvalidRequest, PorticoError
from server.providers import Capabilities
from server.providers.http_upstream import HttpUpstream
from server.translate.internal_to_openai_request import caller_param, openai_body
from server.translate.openai_chunks_to_internal import (
    OpenAIChunkReader, carries_content, completion_events, openai_answer,
)


def openai_auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class OpenAIProvider:
    capabilities = Capabilities(tool_calls=True, json_output=True, dialects=frozenset({Dialect.OPENAI}))

    def __init__(self, upstream: HttpUpstream, spec: UpstreamSpec, *, model_id: str) -> None:
        self._upstream = upstream
        self._model = spec.model
        self._max_tokens_field = spec.max_tokens_field
        self._model_id = model_id  # ours, for messages; the upstream's name and URL stay out of them
        self._call_ids = random_call_ids("call_")  # for a server's tool calls without an id

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        body = openai_body(request, model=self._model, max_tokens_field=self._max_tokens_field)
        try:
            prompt_estimate = request.estimated_prompt_tokens()
            # The attempt's span is ours until the answer is read: it says what the upstream answered, or failed.
            attempt = self._upstream.attempt("chat/completions", body, self._model_id)
            if not request.stream:
                with attempt:
                    answer = await self._upstream.post_json("chat/completions", body, model_id=self._model_id,
                                                            billed=True, attempt=attempt)
                    # OpenAI-compatible servers may report a failure in a 200 answer; `"error": null` is none (the
                    # openai SDK reads a truthy `error` only).
                    if answer.get("error"):
                        raise self._upstream.stream_error(answer, self._model_id, self._model)
                    generated = completion_events(answer, prompt_estimate=prompt_estimate, stop=request.params.stop,
                                                  call_ids=self._call_ids)
                    if attempt.recording:
                        attempt.answered(openai_answer(answer))
                yield UpstreamObject(Dialect.OPENAI, answer)
                for event in generated:
                    yield event
                return
            reader = OpenAIChunkReader(prompt_estimate=prompt_estimate, stop=request.params.stop,
                                       call_ids=self._call_ids)
            # The prompt's count for an Anthropic caller's message_start (OpenAI reports its own only at the end); a
            # chat caller's stream has no place for it, and skips the event's trip through every layer.
            started = request.source is not None and request.source.dialect is Dialect.OPENAI
            try:
                with attempt:
                    async with self._upstream.stream("chat/completions", body, model_id=self._model_id,
                                                     attempt=attempt) as events:
                        async for event in events:
                            if event.data == b"[DONE]":
                                break
                            chunk = self._upstream.event_object(event.data, self._model_id)
                            if event.event == "error" and not chunk.get("error"):  # the error object itself (llama.cpp)
                                chunk = {"error": chunk}
                            if chunk.get("error"):  # `"error": null`, in every chunk of some servers, is none
                                raise self._upstream.stream_error(chunk, self._model_id, self._model)
                            made = reader.feed(chunk)  # first: a chunk that is not the API's never reaches the caller
                            if attempt.recording:
                                attempt.answered(openai_answer(chunk))
                            yield UpstreamObject(Dialect.OPENAI, chunk, carries_content(chunk))
                            if not started:
                                started = True
                                yield Started(prompt_estimate)
                            for generated in made:
                                yield generated
                    finished = reader.end()  # a stream cut short fails its attempt
            except PorticoError as error:  # broken off after the usage chunk: settled with the usage it reported
                error.usage_reported = error.usage_reported or reader.reported()
                raise
            yield finished
        except InvalidRequest as error:  # its param names a field of the body built here: the caller's instead
            if error.param:
                error.param = caller_param(request, error.param, max_tokens_field=self._max_tokens_field)
            raise

    async def close(self) -> None:
        """Closes the pooled client, which other models may share: closing it twice is harmless."""
        await self._upstream.close()
