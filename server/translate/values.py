"""Reading google.protobuf.Value fields (the polymorphic parts of the dialects) into plain Python."""

from __future__ import annotations

from google.protobuf import struct_pb2

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
