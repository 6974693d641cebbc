"""A real HTTP upstream for tests: an ASGI app under uvicorn on 127.0.0.1 (port 0), in its own thread and loop.

By default it answers as the echo models of tests/upstream_echo.py (OpenAI chat completions, Anthropic Messages):
a stream when the request asks for one, else one JSON answer. Tests script faults by queueing Cues, each consumed by
the next request: a status and body, a delay before answering, literal SSE frames, a pause between frames, a
connection dropped after some frames (a JSON answer is sent as two frames, its halves, so it can be cut). It records every
request and every client that went away mid-answer, so tests can count retries and see cancellations.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn

from tests.upstream_echo import echo_chat, echo_count_tokens, echo_images, echo_messages


@dataclass(frozen=True)
class Cue:
    status: int = 200
    body: dict | bytes | None = None  # a whole answer (JSON), instead of the default one
    headers: dict[str, str] = field(default_factory=dict)
    frames: list[bytes] | None = None  # literal SSE frames, instead of the default answer
    delay: float = 0.0  # before the status line
    frame_delay: float = 0.0  # before each frame after the first (a JSON answer's second half)
    drop_after: int | None = None  # close the connection after this many frames, mid-answer (JSON: 1 of 2 halves)


@dataclass(frozen=True)
class Seen:
    path: str
    headers: dict[str, str]
    body: dict
    raw: bytes = b""  # the body's bytes as sent: key order and number spellings


class _Dropped(Exception):
    """Raised inside the app: uvicorn then closes the connection without finishing the chunked body."""


class UpstreamDouble:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.gone = 0  # answers whose client went away before the end
        self.defaults: dict[str, Callable[[dict], list[bytes] | dict]] = {  # SSE frames, or a JSON answer
            "/v1/chat/completions": echo_chat, "/v1/messages": echo_messages,
            "/v1/messages/count_tokens": echo_count_tokens,
        }
        self.files: dict[str, bytes] = {}  # served at /files/<name>, for image links
        self.file_types: dict[str, str] = {}  # a file's content-type, when not image/png ("": none sent)
        self._cues: collections.deque[Cue] = collections.deque()
        self.default_cue = Cue()  # for requests when no cue is queued
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def cue(self, *cues: Cue) -> None:
        self._cues.extend(cues)

    def reset(self) -> None:
        self._cues.clear()
        self.files.clear()
        self.file_types.clear()
        self.seen.clear()
        self.gone = 0

    def start(self) -> UpstreamDouble:
        config = uvicorn.Config(self._app, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
                                interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the upstream double did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    async def _app(self, scope, receive, send) -> None:
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw) if raw else {}  # the json module: integers of any size exactly as sent
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append(Seen(scope["path"], headers, body, raw))
        cue = self._cues.popleft() if self._cues else self.default_cue
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch(receive, gone))
        try:
            await self._answer(scope["path"], body, cue, send, gone)
        finally:
            watcher.cancel()

    async def _watch(self, receive, gone: asyncio.Event) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    async def _answer(self, path: str, body: dict, cue: Cue, send, gone: asyncio.Event) -> None:
        await asyncio.sleep(cue.delay)
        if cue.body is None and cue.frames is None and path == "/v1/images/generations":
            cue = Cue(body=echo_images(body, self.files, f"http://127.0.0.1:{self.port}"))
        elif cue.body is None and cue.frames is None and path.startswith("/files/"):
            name = path.removeprefix("/files/")
            data = self.files.get(name)
            content_type = self.file_types.get(name, "image/png")
            headers = [(b"content-type", content_type.encode())] if content_type else []
            await send({"type": "http.response.start", "status": 200 if data else 404, "headers": headers})
            await send({"type": "http.response.body", "body": data or b""})
            return
        status = cue.status
        if cue.body is not None:
            answer = cue.body
        elif cue.frames is not None:
            answer = cue.frames
        elif path in self.defaults:
            answer = self.defaults[path](body)
        else:
            answer, status = {"error": "no route"}, 404
        if isinstance(answer, list):
            content_type, frames = b"text/event-stream", answer
        else:
            data = answer if isinstance(answer, bytes) else json.dumps(answer, separators=(",", ":")).encode()
            content_type, frames = b"application/json", [data[:len(data) // 2], data[len(data) // 2:]]
        headers = [(b"content-type", content_type), *_encoded(cue.headers)]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, frame in enumerate(frames):
            if cue.drop_after is not None and i == cue.drop_after:
                raise _Dropped()
            if i and cue.frame_delay:
                await asyncio.sleep(cue.frame_delay)
            if gone.is_set():
                self.gone += 1
                return
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in headers.items()]
