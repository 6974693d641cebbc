"""Reading google.protobuf.Value fields (the polymorphic parts of the dialects) into plain Python."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from server.errors import InvalidRequest


def is_set(message, field: str) -> bool:
    """A Value field counts as unset when absent or JSON null."""
    return message.HasField(field) and getattr(message, field).WhichOneof("kind") not in (None, "null_value")


def text_or_parts(value: struct_pb2.Value, param: str, *, part_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts [{"type": "text", "text": ...}], as one string."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind in (None, "null_value"):
        return ""
    if kind != "list_value":
        raise InvalidRequest(f"`{param}` must be a string or a list of content parts.", param=param)
    texts = []
    for i, part in enumerate(value.list_value.values):
        where = f"{param}[{i}]"
        if part.WhichOneof("kind") != "struct_value":
            raise InvalidRequest(f"`{where}` must be an object with a `type`.", param=where)
        fields = part.struct_value.fields
        part_type = fields["type"].string_value if "type" in fields else ""
        if part_type not in part_types:
            raise InvalidRequest(
                f"Content part type `{part_type[:40]}` is not supported by this model; "
                f"supported: {', '.join(part_types)}.",
                param=f"{where}.type",
            )
        text = fields.get("text")
        if text is None or text.WhichOneof("kind") != "string_value":
            raise InvalidRequest(f"`{where}.text` must be a string.", param=f"{where}.text")
        texts.append(text.string_value)
    return "\n".join(texts)


def string_list(value: struct_pb2.Value, param: str, *, max_items: int) -> tuple[str, ...]:
    """A string or a list of strings (e.g. `stop`), as a tuple."""
    kind = value.WhichOneof("kind")
    if kind in (None, "null_value"):
        return ()
    if kind == "string_value":
        items = [value]
    elif kind == "list_value":
        items = list(value.list_value.values)
    else:
        raise InvalidRequest(f"`{param}` must be a string or a list of strings.", param=param)
    if len(items) > max_items:
        raise InvalidRequest(f"`{param}` takes at most {max_items} strings.", param=param)
    out = []
    for item in items:
        if item.WhichOneof("kind") != "string_value" or not item.string_value:
            raise InvalidRequest(f"`{param}` must contain only non-empty strings.", param=param)
        out.append(item.string_value)
    return tuple(out)


def check_range(message, name: str, low: float, high: float) -> None:
    """An optional numeric field, when set, must lie in [low, high]."""
    if message.HasField(name):
        value = getattr(message, name)
        if not low <= value <= high:
            raise InvalidRequest(f"`{name}` must be between {low:g} and {high:g}, got {value:g}.", param=name)


def wire_body(message: Message) -> dict:
    """The request as its JSON body again (field names as on the wire, unset fields absent).

    json_format prints 64-bit integers as strings (the proto3 JSON rule) and numbers inside Structs as floats; both
    are put back, so an upstream sees `"seed": 7` and a schema's `"minimum": 1`, as the caller wrote them.
    """
    body = _integral(json_format.MessageToDict(message, preserving_proto_field_name=True))
    for field in message.DESCRIPTOR.fields:
        if field.name in body and field.type in _INT64_TYPES and not field.is_repeated:
            body[field.name] = int(body[field.name])
    return body


_INT64_TYPES = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)


def _integral(value):
    """Whole floats back to ints, all the way down (google.protobuf.Value keeps every number as a double)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def plain(value: struct_pb2.Value | struct_pb2.Struct):
    """A google.protobuf.Value or Struct as plain JSON (dicts, lists, ...), whole numbers as ints."""
    return _integral(json_format.MessageToDict(value))
