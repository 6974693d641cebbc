"""Server-sent events in: the bytes of a text/event-stream answer, as they arrive, into events
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation). Pure: no I/O, so
it is tested on byte transcripts split anywhere (server/providers/http_upstream.py feeds it an upstream's answer).
"""

from __future__ import annotations

from dataclasses import dataclass


_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" when the stream sent no `event:` line
    data: bytes  # the `data:` lines joined with "\n": bytes, which the JSON parser reads without a decoding first


class EventTooLarge(Exception):
    """An event (its data so far, and the line not ended yet) grew past the decoder's `max_event_bytes`."""


class SseDecoder:
    """Lines end with "\\r\\n", "\\n" or "\\r", and a read may end anywhere, even between the two bytes of "\\r\\n".
    Only `event:` and `data:` fields matter here (and llama.cpp's `error:`, below); comments (":") and other fields
    are skipped. An event bigger than `max_event_bytes` is EventTooLarge, raised as soon as it is: a stream that
    never ends its line must not take the reader's memory."""

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._event = b""
        self._data: list[bytes] = []
        self._data_bytes = 0
        # The start of a line not ended yet, in the pieces it came in: joined once, when its end arrives (joining
        # at every read would copy a long line over and over).
        self._rest: list[bytes] = []
        self._rest_bytes = 0
        self._after_cr = False  # the last chunk ended with "\r", whose "\n" may be the next chunk's first byte
        self._max = max_event_bytes
        self._start = b""  # the stream's first bytes while they may still be a byte order mark, which is skipped
        self._started = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events that `chunk` completes."""
        if not self._started:
            chunk = self._skip_bom(chunk)
        if not chunk:
            return []
        if self._after_cr:
            self._after_cr = False
            if chunk[:1] == b"\n":  # a "\r\n" split between two reads ends one line, not two
                chunk = chunk[1:]
        if not chunk:
            return []
        if self._rest:
            if b"\n" not in chunk and b"\r" not in chunk:  # the line goes on
                self._keep(chunk)
                return []
            chunk = b"".join((*self._rest, chunk))
            self._rest, self._rest_bytes = [], 0
        lines = chunk.splitlines()  # bytes: at "\r\n", "\n" and "\r" only
        if chunk[-1] == 0x0D:
            self._after_cr = True
        elif chunk[-1] != 0x0A:
            self._keep(lines.pop())
        return self._read(lines)

    def end(self) -> list[SseEvent]:
        """The stream ended: a last line without its line break, and a last event without its blank line."""
        lines = [b"".join(self._rest)] if self._rest else []
        self._rest, self._rest_bytes = [], 0
        events = self._read(lines)
        if self._data:
            events.append(self._dispatch())
        return events

    def _skip_bom(self, chunk: bytes) -> bytes:
        """The standard skips one UTF-8 byte order mark at the start; read as part of the first line, it would hide
        that line's field name (and so lose the first event). Its bytes may arrive in separate reads (a stream that
        ends within them holds no event anyway)."""
        data = self._start + chunk
        if len(data) < len(_BOM) and _BOM.startswith(data):
            self._start = data
            return b""
        self._started, self._start = True, b""
        return data.removeprefix(_BOM)

    def _read(self, lines: list[bytes]) -> list[SseEvent]:
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(self._dispatch())
                self._event = b""
            elif line.startswith(b"data:"):
                data = line[6:] if line.startswith(b"data: ") else line[5:]
                self._data.append(data)
                self._data_bytes += len(data)
                if self._max is not None and self._data_bytes > self._max:  # inline: once per line of every event
                    self._check()
            elif line.startswith(b"event:"):
                self._event = line[6:].strip()
            elif line.startswith(b"error:"):
                # llama.cpp's server (before it moved them into `data:`) writes a failure met while streaming as an
                # `error:` field, holding the error object: read as `event: error` with that data.
                self._event = b"error"
                self._read([b"data" + line[5:]])  # a line, not an event's end: no event comes of it
        return events

    def _dispatch(self) -> SseEvent:
        event = SseEvent(self._event.decode("utf-8", "replace") if self._event else "message", b"\n".join(self._data))
        self._event, self._data, self._data_bytes = b"", [], 0
        return event

    def _keep(self, piece: bytes) -> None:
        self._rest.append(piece)
        self._rest_bytes += len(piece)
        self._check()

    def _check(self) -> None:
        if self._max is not None and self._data_bytes + self._rest_bytes > self._max:
            raise EventTooLarge(f"an event of more than {self._max} bytes")
