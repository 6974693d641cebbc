"""Echo models for the upstream double: answers derived from the request, in each dialect's streamed form when the
request has `"stream": true`, else as the one JSON answer the real servers send (from the same echo, so both agree).

A word is a token: the answer is "echo" and the last message's words, limited by the token limit, cut before a
stop word; a tool call instead when the request's tool choice requires one.
"""

from __future__ import annotations

import base64
import io

import orjson
from PIL import Image


def sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def _words(content) -> list[str]:
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "").split()


def _echo(last_content, limit: int, stop: list[str]) -> tuple[list[str], str]:
    """The echo answer's words and why it ended: "end", "length" or "stop:<the stop string>"."""
    words = ["echo", *_words(last_content)]
    for i, word in enumerate(words):
        if word in stop:
            return words[:i], f"stop:{word}"
    return (words, "end") if len(words) <= limit else (words[:limit], "length")


def echo_chat(body: dict) -> list[bytes] | dict:
    """OpenAI chunks: "echo" and the last message's words, one per chunk, limited by max_tokens (a word is a
    token) and cut before a `stop` word; a tool call instead when tool_choice requires one. prompt_tokens = the
    words of every message. Not streamed: the chat.completion, with usage."""
    messages = body.get("messages") or []
    prompt = sum(len(_words(m.get("content"))) for m in messages)
    stop = body.get("stop") or []
    limit = body.get("max_tokens") or body.get("max_completion_tokens") or 1000
    words, why = _echo(messages[-1].get("content") if messages else "", limit,
                       [stop] if isinstance(stop, str) else stop)
    choice = body.get("tool_choice")
    tools = body.get("tools") or []
    call = None
    if tools and (choice == "required" or isinstance(choice, dict)):
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None  # allowed_tools: none
        name = named or tools[0]["function"]["name"]
        call = {"id": "call_1", "type": "function", "function": {
            "name": name, "arguments": orjson.dumps({"echo": " ".join(words[1:])}).decode()}}
        sent, reason = 3, "tool_calls"
    else:
        sent, reason = len(words), "length" if why == "length" else "stop"
    usage = {"prompt_tokens": prompt, "completion_tokens": sent, "total_tokens": prompt + sent}
    if not body.get("stream"):
        message = {"role": "assistant", "content": None, "tool_calls": [call]} if call else {
            "role": "assistant", "content": " ".join(words)}
        return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "usage": usage}
    base = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}
    frames = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    if call:
        arguments = call["function"]["arguments"]
        start = {"index": 0, **call, "function": {**call["function"], "arguments": ""}}
        for delta in ({"tool_calls": [start]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": arguments[:5]}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": arguments[5:]}}]}):
            frames.append(sse({**base, "choices": [{"index": 0, "delta": delta}]}))
    else:
        for i, word in enumerate(words):
            delta = {"content": word if i == 0 else " " + word}
            frames.append(sse({**base, "choices": [{"index": 0, "delta": delta}]}))
    frames.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        frames.append(sse({**base, "choices": [], "usage": usage}))
    return [*frames, b"data: [DONE]\n\n"]


def echo_messages(body: dict) -> list[bytes] | dict:
    """The same echo model speaking Anthropic Messages: a text block (or a tool_use block when tool_choice is
    `any` or `tool`), stop_sequences honoured; input_tokens = the words of the system prompt and every message.
    Not streamed: the `message`."""
    messages = body.get("messages") or []
    system = body.get("system") or ""
    prompt = sum(len(_words(m.get("content"))) for m in messages) + len(_words(system))
    words, why = _echo(messages[-1].get("content") if messages else "", body["max_tokens"],
                       body.get("stop_sequences") or [])
    choice = body.get("tool_choice") or {}
    if body.get("tools") and choice.get("type") in ("any", "tool"):
        name = choice.get("name") or body["tools"][0]["name"]
        echoed = {"echo": " ".join(words[1:])}
        block = {"type": "tool_use", "id": "toolu_1", "name": name, "input": echoed}
        sent, reason, stop_sequence = 3, "tool_use", None
    else:
        block = {"type": "text", "text": " ".join(words)}
        sent = len(words)
        reason = {"end": "end_turn", "length": "max_tokens"}.get(why, "stop_sequence")
        stop_sequence = why.removeprefix("stop:") if why.startswith("stop:") else None
    message = {"id": "msg_up", "type": "message", "role": "assistant", "content": [block], "model": body.get("model"),
               "stop_reason": reason, "stop_sequence": stop_sequence,
               "usage": {"input_tokens": prompt, "output_tokens": sent}}
    if not body.get("stream"):
        return message
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt, "output_tokens": 1}}
    if block["type"] == "tool_use":
        arguments = orjson.dumps(block["input"]).decode()
        deltas = [{"type": "input_json_delta", "partial_json": part} for part in (arguments[:5], arguments[5:])]
        block = {**block, "input": {}}
    else:
        deltas = [{"type": "text_delta", "text": w if i == 0 else " " + w} for i, w in enumerate(words)]
        block = {**block, "text": ""}
    frames = [sse({"type": "message_start", "message": start}, "message_start"),
              sse({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start"),
              sse({"type": "ping"}, "ping")]
    frames += [sse({"type": "content_block_delta", "index": 0, "delta": d}, "content_block_delta") for d in deltas]
    frames.append(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    frames.append(sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                       "usage": {"output_tokens": sent}}, "message_delta"))
    return [*frames, sse({"type": "message_stop"}, "message_stop")]


def echo_count_tokens(body: dict) -> dict:
    """Anthropic's count_tokens for the echo model: the words of the system prompt and every message (its
    `input_tokens`), plus one a tool."""
    messages = body.get("messages") or []
    words = sum(len(_words(m.get("content"))) for m in messages) + len(_words(body.get("system") or ""))
    return {"input_tokens": words + len(body.get("tools") or [])}


def tiny_png(seed: int) -> bytes:
    """A small real PNG (the double does not scale to the requested size: the gateway passes on what it gets)."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (seed % 256, 80, 160)).save(out, "PNG")
    return out.getvalue()


def echo_images(body: dict, files: dict[str, bytes], base_url: str) -> dict:
    """An images answer: `n` PNGs as base64, or (response_format "url") as links to the double itself."""
    data = []
    for i in range(body.get("n") or 1):
        png = tiny_png(len(body.get("prompt", "")) + i)
        if body.get("response_format") == "url":
            name = f"img-{len(files)}.png"
            files[name] = png
            data.append({"url": f"{base_url}/files/{name}", "revised_prompt": f"echo {body.get('prompt')}"})
        else:
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": f"echo {body.get('prompt')}"})
    return {"created": 1, "data": data}
