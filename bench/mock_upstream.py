"""A fast mock OpenAI-compatible upstream: `POST /v1/chat/completions` answers one fixed completion, or a fixed
SSE stream when the body asks for `"stream": true`. Standard library only (asyncio protocol, no HTTP framework),
so that it is not the bottleneck of the benchmark: it parses just enough HTTP/1.1 for keep-alive clients.

A request whose upstream model is `mock-slow` gets a slow stream instead (SLOW_CHUNKS chunks, SLOW_INTERVAL s
apart), used to hold many streams open at once.

    python -m bench.mock_upstream --port 18001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

CONTENT = "Hello! This is a fixed answer from the mock upstream."
WORDS = CONTENT.split(" ")
SLOW_CHUNKS = 20
SLOW_INTERVAL = 0.25

_COMPLETION = json.dumps({
    "id": "chatcmpl-mock", "object": "chat.completion", "created": 1767225600, "model": "mock-gpt",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": CONTENT}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": len(WORDS), "total_tokens": 12 + len(WORDS)},
}, separators=(",", ":")).encode()


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1767225600, "model": "mock-gpt"}
    if usage is not None:
        return _sse({**base, "choices": [], "usage": usage})
    return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _stream_frames(words: list[str]) -> list[bytes]:
    frames = [_chunk({"role": "assistant", "content": ""})]
    frames += [_chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
    frames.append(_chunk({}, "stop"))
    frames.append(_chunk({}, usage={"prompt_tokens": 12, "completion_tokens": len(words),
                                    "total_tokens": 12 + len(words)}))
    frames.append(b"data: [DONE]\n\n")
    return frames


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_BODY = b"".join(_chunked(f) for f in _stream_frames(WORDS)) + b"0\r\n\r\n"
_JSON_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Connection: keep-alive\r\n\r\n" % len(_COMPLETION)) + _COMPLETION
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")
_STREAM_RESPONSE = _STREAM_HEAD + _STREAM_BODY
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
# An OTLP/HTTP collector's answer to `POST /v1/traces` (an empty ExportTraceServiceResponse), for bench.handler --tracing
_TRACES_TAKEN = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"


class _Http(asyncio.Protocol):
    __slots__ = ("transport", "buffer", "busy")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.busy = False  # a slow stream is being written; later requests wait in the buffer

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17:stop if stop >= 0 else len(lower)])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            if head.startswith(b"POST /v1/traces "):
                self.transport.write(_TRACES_TAKEN)
            elif not head.startswith(b"POST ") or b"/chat/completions " not in head[:64]:
                self.transport.write(_NOT_FOUND)
            elif b'"stream":true' in body or b'"stream": true' in body:
                if b'"mock-slow"' in body:
                    self.busy = True
                    asyncio.ensure_future(self._slow_stream())
                    return
                self.transport.write(_STREAM_RESPONSE)
            else:
                self.transport.write(_JSON_RESPONSE)

    async def _slow_stream(self) -> None:
        try:
            self.transport.write(_STREAM_HEAD)
            words = [f"w{i}" for i in range(SLOW_CHUNKS)]
            frames = _stream_frames(words)
            for frame in frames[:-3]:
                self.transport.write(_chunked(frame))
                await asyncio.sleep(SLOW_INTERVAL)
                if self.transport is None or self.transport.is_closing():
                    return
            self.transport.write(b"".join(_chunked(f) for f in frames[-3:]) + b"0\r\n\r\n")
        finally:
            self.busy = False
        if self.buffer and self.transport is not None:
            self._serve()

    def connection_lost(self, exc) -> None:
        self.transport = None


async def _main(host: str, port: int, ready_fd: int | None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"mock upstream on http://{host}:{port}/v1", flush=True)
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18001)
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port, None))


if __name__ == "__main__":
    main()
