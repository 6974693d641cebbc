"""Request bytes that do not decode as the RPC's message: a 400 naming the field, not grpc's 500; and request
messages over REST's 8 MiB cap: a 413, as a REST body that size gets from Envoy.

grpc calls the deserializer before any handler runs, and a DecodeError there (corrupt wire format, or a
google.protobuf.Value/Struct nested deeper than the decoder's recursion limit of 100) became an UNKNOWN status
with "Unexpected DecodeError" and no access-log line. The interceptor installs `tolerant(...)` as the
deserializer: it hands the handler an `Undecodable` instead, which the interceptor turns into InvalidRequest
inside the observed call, so the request is answered, logged and counted like any other bad request.

Native gRPC calls pass Envoy untouched, so the 8 MiB cap on REST bodies (envoy.yaml max_request_bytes) is applied
here: to the whole message, or for the REST bindings' HttpBody to its body, which Envoy lets through at up to 8 MiB.
grpc itself refuses messages over the server's max_receive_message_length (server/app.py) before this runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from google.api import httpbody_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from server.errors import InvalidRequest, RequestTooLarge

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
            param = _offending_field(message_class, raw) if isinstance(message_class, type) else None
            nested = "nested too deeply" if "depth" in str(exc).lower() or isinstance(exc, RecursionError) else None
            what = nested or ("not valid UTF-8" if _is_string(message_class, param) else
                              "not a valid protobuf encoding")
            return Undecodable(InvalidRequest(f"The request could not be decoded: {param or 'a field'} is {what}.",
                                              param=param))

    return deserialize


def _is_string(message_class: object, param: str | None) -> bool:
    """Whether `param` names a string field, whose bytes fail to decode only when they are not UTF-8 (a REST
    path's or query's %-escape, such as `/v1/models/%ff`, lands in one)."""
    if not param or not isinstance(message_class, type):
        return False
    field = message_class.DESCRIPTOR.fields_by_name.get(param.split("[")[0])
    return field is not None and field.type == FieldDescriptor.TYPE_STRING


def _body_over_limit(raw: bytes) -> bool:
    """Whether an HttpBody's body (not its content type around it) is over the cap; one that does not decode is
    left to the decoder's own error."""
    try:
        return len(httpbody_pb2.HttpBody.FromString(raw).data) > MAX_REQUEST_BYTES
    except DecodeError:
        return False


def _offending_field(message_class: type[Message], raw: bytes) -> str | None:
    """The first top-level field (with its index if repeated) that does not decode on its own."""
    fields = message_class.DESCRIPTOR.fields_by_number
    seen: dict[int, int] = {}
    try:
        for number, chunk in _top_level_fields(raw):
            index = seen[number] = seen.get(number, -1) + 1
            try:
                message_class.FromString(chunk)
            except (DecodeError, RecursionError):
                field = fields.get(number)
                if field is None:
                    return None
                is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
                if field.is_repeated and not is_map:
                    return f"{field.name}[{index}]"
                return field.name
    except (IndexError, ValueError):
        return None  # the framing itself is broken: no field to name
    return None


def _top_level_fields(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(field number, the field's bytes with its tag) for each top-level field of a wire-format message."""
    pos = 0
    while pos < len(raw):
        start = pos
        tag, pos = _varint(raw, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _varint(raw, pos)
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError("groups are not used by Portico's messages")
        if pos > len(raw):
            raise ValueError("truncated")
        yield number, raw[start:pos]


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
