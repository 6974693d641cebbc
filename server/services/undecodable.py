"""Request bytes that do not decode as the RPC's message: a 400 naming the field, not grpc's 500; and request
messages over REST's 8 MiB cap: a 413, as a REST body that size gets from Envoy.

grpc calls the deserializer before any handler runs, and a DecodeError there (corrupt wire format, or a
google.protobuf.Value/Struct nested deeper than the decoder's recursion limit of 100) became an UNKNOWN status
with "Unexpected DecodeError" and no access-log line. The interceptor installs `tolerant(...)` as the
deserializer: it hands the handler an `Undecodable` instead, which the interceptor turns into InvalidRequest
inside the observed call, so the request is answered, logged and counted like any other bad request.

Native gRPC calls pass Envoy's buffer filter untouched, so the 8 MiB cap on REST bodies (envoy.yaml
max_request_bytes) is applied here: to the whole message, or for the REST bindings' HttpBody to its body, which Envoy
lets through at up to 8 MiB. Envoy refuses a portico.v1 request over its 16 MiB buffer (gateway/grpc_replies.py), and
grpc one over the server's max_receive_message_length (server/app.py), before this runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from google.api import httpbody_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from server.errors import InvalidRequest, RequestTooLarge
from server.translate.values import JSON_VALUES, join

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # envoy.yaml's max_request_bytes for REST bodies


@dataclass(frozen=True, slots=True)
class Undecodable:
    error: InvalidRequest


def tolerant(deserializer: Callable[[bytes], Message] | None) -> Callable[[bytes], Message | Undecodable] | None:
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)  # a generated class's FromString
    body_only = message_class is httpbody_pb2.HttpBody

    def deserialize(raw: bytes) -> Message | Undecodable:
        if len(raw) > MAX_REQUEST_BYTES and (not body_only or _body_over_limit(raw)):
            return Undecodable(RequestTooLarge(
                f"The request is too large: {len(raw)} bytes (limit 8 MiB, as for REST bodies)."))
        try:
            return deserializer(raw)
        except (DecodeError, RecursionError) as exc:
            nested = "depth" in str(exc).lower() or isinstance(exc, RecursionError)
            found = _offending_field(message_class, raw, descend=not nested) if isinstance(message_class, type) \
                else None
            param, field = found or (None, None)
            what = ("nested too deeply" if nested else
                    "not valid UTF-8" if field is not None and field.type == FieldDescriptor.TYPE_STRING else
                    "not a valid protobuf encoding")
            return Undecodable(InvalidRequest(f"The request could not be decoded: {param or 'a field'} is {what}.",
                                              param=param))

    return deserialize


def _body_over_limit(raw: bytes) -> bool:
    """Whether an HttpBody's body (not its content type around it) is over the cap; one that does not decode is
    left to the decoder's own error."""
    try:
        return len(httpbody_pb2.HttpBody.FromString(raw).data) > MAX_REQUEST_BYTES
    except DecodeError:
        return False


def _offending_field(message_class: type[Message], raw: bytes, path: str = "", *,
                     descend: bool = True) -> tuple[str | None, FieldDescriptor | None] | None:
    """The path (`messages[1].content[0].text`) and descriptor of the innermost field that does not decode; None
    when the framing itself is broken. Inside google.protobuf.Value, Struct and ListValue the path names JSON
    members and items, as a REST caller's param does. `descend`: False names the top-level field only."""
    fields = message_class.DESCRIPTOR.fields_by_number
    json_value = message_class.DESCRIPTOR.full_name in JSON_VALUES
    seen: dict[int, int] = {}
    try:
        for number, chunk, payload in _top_level_fields(raw):
            index = seen[number] = seen.get(number, -1) + 1
            try:
                message_class.FromString(chunk)
                continue
            except (DecodeError, RecursionError):
                pass
            field = fields.get(number)
            if field is None:
                return path or None, None
            here, inner = path if json_value else join(path, field.name), field.message_type
            if inner is not None and inner.GetOptions().map_entry:  # keys are strings in Portico's messages
                entry = {n: p for n, _, p in _top_level_fields(payload)}
                try:
                    here = join(here, entry.get(1, b"").decode())
                except UnicodeDecodeError:
                    return here, inner.fields_by_name["key"]
                field, payload = inner.fields_by_name["value"], entry.get(2)
                inner = field.message_type
            elif field.is_repeated:
                here = f"{here}[{index}]"
            if descend and inner is not None and payload is not None:
                return _offending_field(GetMessageClass(inner), payload, here) or (here, field)
            return here, field
    except (IndexError, ValueError):
        return None  # the framing itself is broken: no field to name
    return None


def _top_level_fields(raw: bytes) -> Iterator[tuple[int, bytes, bytes | None]]:
    """(field number, the field's bytes with its tag, its payload when length-delimited) for each top-level field
    of a wire-format message."""
    pos = 0
    while pos < len(raw):
        start, payload = pos, None
        tag, pos = _varint(raw, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _varint(raw, pos)
            payload = raw[pos:pos + length]
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError("groups are not used by Portico's messages")
        if pos > len(raw):
            raise ValueError("truncated")
        yield number, raw[start:pos], payload


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
