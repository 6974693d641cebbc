"""An OpenAI-compatible upstream that compresses its answers although Portico asks for identity (as a compressing
proxy in front of it does), through the whole stack with the official openai SDK: gzip answers and streams reach
the caller as if plain, and a coding Portico does not decode is a 502 that names it."""

from __future__ import annotations

import gzip
import zlib

import openai
import orjson
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import echo_chat
from tests.upstream_support import UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    provider = (f"{{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up, "
                "retry: {attempts: 1}, timeouts: {read: 2, answer: 2}}")
    models = f"  - {{id: chat-gz, endpoint: /v1/chat/completions, provider: {provider}}}\n"
    with upstream_gateway(tmp_path_factory.mktemp("compressed-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def gzipped_frames(frames: list[bytes]) -> list[bytes]:
    """Each SSE frame flushed into its own piece of one gzip stream, as a compressing proxy sends a stream."""
    compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    pieces = [compressor.compress(frame) + compressor.flush(zlib.Z_SYNC_FLUSH) for frame in frames]
    pieces[-1] += compressor.flush()
    return pieces


def test_gzipped_answers_and_streams_reach_the_openai_sdk_as_plain_ones(oai, double):
    answer = echo_chat({"model": "gpt-up", "messages": HELLO})
    double.cue(Cue(body=gzip.compress(orjson.dumps(answer)), headers={"content-encoding": "gzip"}))
    completion = oai.chat.completions.create(model="chat-gz", messages=HELLO, max_tokens=8)
    assert completion.choices[0].message.content == "echo Say hello."
    assert completion.usage.completion_tokens == 3

    frames = echo_chat({"model": "gpt-up", "messages": HELLO, "stream": True,
                        "stream_options": {"include_usage": True}})
    double.cue(Cue(frames=gzipped_frames(frames), headers={"content-encoding": "gzip"}))
    chunks = list(oai.chat.completions.create(model="chat-gz", messages=HELLO, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo Say hello."
    assert chunks[-1].usage.completion_tokens == 3
    assert double.seen[0].headers["accept-encoding"] == "identity"


def test_a_coding_portico_does_not_decode_is_a_502_naming_it(oai, double):
    double.cue(Cue(body=b"\x8b\x02\x80{}\x03", headers={"content-encoding": "br"}))
    with pytest.raises(openai.APIStatusError) as caught:
        oai.chat.completions.create(model="chat-gz", messages=HELLO, max_tokens=8)
    assert caught.value.status_code == 502
    assert "answered with content-encoding br, which Portico does not decode" in caught.value.message
