"""SseDecoder on byte transcripts: the same events however the bytes are split, whatever the line endings."""

from __future__ import annotations

import pytest

from server.render import SseDecoder, SseEvent
from server.render.sse_decoder import EventTooLarge

TRANSCRIPT = (
    b": a comment\r\n"
    b"event: message_start\r\n"
    b"data: {\"type\":\"message_start\"}\r\n"
    b"\r\n"
    b"data: first\n"
    b"data:second\n"
    b"\n"
    b"id: 7\r"
    b"retry: 10\r"
    b"data: caf\xc3\xa9\r"
    b"\r"
    b"\n\n\n"
    b"event: ping\n"
    b"\n"
    b"event:  last  \n"
    b"data: {\"done\": true}"
)
EVENTS = [
    SseEvent("message_start", b'{"type":"message_start"}'),
    SseEvent("message", b"first\nsecond"),
    SseEvent("message", "café".encode()),
    SseEvent("last", b'{"done": true}'),
]


def decode(chunks: list[bytes]) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.end()


def test_whole():
    assert decode([TRANSCRIPT]) == EVENTS


def test_byte_by_byte():
    assert decode([TRANSCRIPT[i:i + 1] for i in range(len(TRANSCRIPT))]) == EVENTS


@pytest.mark.parametrize("cut", range(1, len(TRANSCRIPT)))
def test_split_anywhere(cut):
    assert decode([TRANSCRIPT[:cut], b"", TRANSCRIPT[cut:]]) == EVENTS


def test_llama_cpp_s_error_field_is_an_error_event():
    stream = b'data: {"a":1}\n\nerror: {"code":500}\n\nerror:{"code":400}\n\ndata: [DONE]\n\n'
    assert decode([stream[i:i + 1] for i in range(len(stream))]) == [
        SseEvent("message", b'{"a":1}'), SseEvent("error", b'{"code":500}'), SseEvent("error", b'{"code":400}'),
        SseEvent("message", b"[DONE]")]


@pytest.mark.parametrize("cut", range(0, 6))
def test_a_byte_order_mark_at_the_start_is_skipped_however_it_is_split(cut):
    stream = b"\xef\xbb\xbfevent: first\ndata: 1\n\n" + TRANSCRIPT
    assert decode([stream[:cut], stream[cut:]]) == [SseEvent("first", b"1"), *EVENTS]


def test_only_the_first_byte_order_mark_is_skipped():
    assert decode([b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n", b"data: \xef\xbb\xbfy\n\n"]) == [
        SseEvent("message", b"\xef\xbb\xbfy")]  # the second mark makes the first line no `data:` line


def test_a_crlf_split_between_reads_ends_one_line():
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # the "\n" of the "\r\n", not an empty line
    assert decoder.feed(b"\r\n") == [SseEvent("message", b"a")]


def test_events_come_out_as_soon_as_their_blank_line_arrives():
    decoder = SseDecoder()
    assert decoder.feed(b"data: [DONE]\n") == []
    assert decoder.feed(b"\n") == [SseEvent("message", b"[DONE]")]
    assert decoder.end() == []


# The limit counts an event's data so far, and its line not ended yet whole ("data: " included).


def test_an_event_of_at_most_the_limit_is_decoded_however_its_bytes_come():
    decoder = SseDecoder(max_event_bytes=16)
    assert decoder.feed(b"data: 01234") == []
    assert decoder.feed(b"56") == []
    assert decoder.feed(b"789\n") == []
    assert decoder.feed(b"\n") == [SseEvent("message", b"0123456789")]
    assert decoder.feed(b"data: 01234\ndata: 5678\n\n") == [SseEvent("message", b"01234\n5678")]  # a new event


@pytest.mark.parametrize("chunks", [
    [b"data: 0123456789", b"a"],  # a line not ended yet
    [b"data: 01234\n", b"data: 56789\n", b"data: a"],  # the lines of one event
    [b"data: 0123456789abcdefg\n"],  # one read
], ids=["unended-line", "many-lines", "one-read"])
def test_an_event_past_the_limit_is_refused_as_soon_as_it_is(chunks):
    decoder = SseDecoder(max_event_bytes=16)
    for chunk in chunks[:-1]:
        assert decoder.feed(chunk) == []
    with pytest.raises(EventTooLarge):
        decoder.feed(chunks[-1])
