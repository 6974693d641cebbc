"""Any JSON object a caller sends is either read or refused with a 400 naming a param: the translators, the capability
check and the upstream body builders never fail otherwise (which would be a 500). Seeded random mutations of valid
bodies, every value replaced at every path by JSON of every type."""

from __future__ import annotations

import copy
import random

import pytest

from server.domain import Dialect
from server.errors import InvalidRequest
from server.providers import Capabilities, unsupported
from server.translate.anthropic_to_internal import message_request
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_images import image_request
from server.translate.openai_to_internal import chat_request

# Numbers as orjson parses them: integers up to the unsigned 64-bit range, anything bigger a float.
ODD_VALUES = [None, True, False, 0, -1, 1.5, 2**64 - 1, -(2**63), 1.2e29, 1e308, "", "x" * 3, "\u0000\ud7ff", [], [None], [[]],
              {}, {"type": None}, {"type": "text"}, {"type": "text", "text": 1}, {"type": ["text"]}, [{"type": {}}]]
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "4"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop": ["a"], "logit_bias": {"1": 2},
    "response_format": {"type": "text"}, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5}
MESSAGES = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}], "messages": [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}, {"type": "tool_use", "id": "t1",
                                                                              "name": "f", "input": {"a": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                                          "text": "r"}]}]}],
    "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "w"}],
    "tool_choice": {"type": "tool", "name": "f"}, "stop_sequences": ["x"], "top_k": 3}
IMAGES = {"model": "m", "prompt": "a cat", "n": 2, "size": "256x256", "response_format": "url", "quality": "low"}
TARGETS = [Capabilities(), Capabilities(tool_calls=True, json_output=True, dialects=frozenset({Dialect.OPENAI})),
           Capabilities(tool_calls=True, dialects=frozenset({Dialect.ANTHROPIC}))]


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths(item, (*prefix, i))


def replaced(body, path, value):
    body = copy.deepcopy(body)
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return body


def exercise(kind: str, body: dict) -> None:
    try:
        if kind == "images":
            image_request(body)
            return
        if kind == "chat":
            generation = chat_request(body, default_max_tokens=16).generation
        else:
            generation = message_request(body).generation
        for target in TARGETS:
            unsupported(generation, target)
        openai_body(generation, model="up")
        anthropic_body(generation, model="up")
    except InvalidRequest as refused:  # RequestTooLarge included
        assert refused.kind.http_status in (400, 413)
        assert refused.param is None or isinstance(refused.param, str)


@pytest.mark.parametrize(("kind", "valid"), [("chat", CHAT), ("messages", MESSAGES), ("images", IMAGES)])
def test_every_value_at_every_path_is_read_or_refused_with_a_400(kind, valid):
    exercise(kind, valid)
    for path in list(paths(valid))[1:]:
        for value in ODD_VALUES:
            exercise(kind, replaced(valid, path, value))


@pytest.mark.parametrize(("kind", "valid"), [("chat", CHAT), ("messages", MESSAGES), ("images", IMAGES)])
def test_random_combinations_are_read_or_refused_with_a_400(kind, valid):
    rng = random.Random(15)
    all_paths = list(paths(valid))[1:]
    for _ in range(400):
        body = valid
        for path in rng.sample(all_paths, 3):
            try:
                body = replaced(body, path, rng.choice(ODD_VALUES))
            except (KeyError, IndexError, TypeError):  # an earlier replacement removed the path
                continue
        exercise(kind, body)
