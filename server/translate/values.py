"""Reading a request body (plain JSON, as server/wire_json.py parses it) with precise 400s: each reader names the
offending value by its path in the body (`messages[2].content`), the `param` of the error object.

REST bodies reach the server raw and are parsed here once; typed gRPC requests are turned into the same JSON first
(`proto_to_json`), so both kinds of caller meet the same rules.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping

from google.protobuf import json_format, unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from server import wire_json
from server.domain import Json
from server.errors import InvalidRequest

TEXT_PARTS = {"text": "text"}  # a text part's type -> the member holding its text
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}


def parse_body(data: bytes) -> dict[str, Json]:
    """A request body as a JSON object, or a 400 saying why it is not one."""
    if not data.strip():
        raise InvalidRequest("The request body is empty: send a JSON object.")
    try:
        body = wire_json.loads(data)
    except wire_json.JSONDecodeError as exc:
        raise _why_not_json(data, exc) from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {type_name(body)}.")
    # Counting brackets is C-fast; only a body with enough of them is measured, and only one too deep is walked.
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _deeper_than(data, MAX_DEPTH):
        where = _nested_too_deeply(body) or ""
        raise InvalidRequest(f"`{where}` is nested more than {MAX_DEPTH} levels deep.", param=where or None)
    return body


def _why_not_json(data: bytes, exc: wire_json.JSONDecodeError) -> InvalidRequest:
    """orjson's reason, but where it misleads: bad UTF-8 it calls "surrogates not allowed" at char 0, wherever the
    byte is, and its own nesting limit (1,024 levels) is not the one callers are told of (MAX_DEPTH). A string that
    is not whole characters (a bad byte, or an escaped lone surrogate: a string cut inside an emoji) is named by its
    path, as a typed gRPC request's is (server/services/undecodable.py)."""
    if exc.msg.startswith("depth limit exceeded"):
        return InvalidRequest(f"The request body is nested more than {MAX_DEPTH} levels deep.")
    if "UTF-8" in exc.msg:
        try:
            data.decode()
        except UnicodeDecodeError as bad:
            return InvalidRequest(f"Invalid JSON body: it is not valid UTF-8 (byte 0x{data[bad.start]:02x} at "
                                  f"position {bad.start}).",
                                  param=_broken_string(data.decode(errors="surrogateescape")) or None)
    if "surrogate" in exc.msg and (where := _broken_string(data.decode(errors="surrogateescape"))) is not None:
        # "" is a member's name at the top, which has no path to give as param: the message says what it is.
        what = f"`{where}`" if where else "a member's name"
        return InvalidRequest(f"Invalid JSON body: {what} holds half of a UTF-16 surrogate pair (a string cut "
                              f"inside an emoji, say): {exc}.", param=where or None)
    if exc.msg.startswith(_MAYBE_NOT_FINITE) and (found := _not_finite_number(data)):
        where, shown = found
        return InvalidRequest(f"Invalid JSON body: `{where}` must be a finite number, got {shown}.", param=where)
    return InvalidRequest(f"Invalid JSON body: {exc}.")


# orjson's words for NaN, Infinity (`-Infinity`: "no digit after sign") and a number beyond a double (1e309, or an
# integer of 309 digits and more), each of which Python's json module reads, so its path can be named as a typed
# gRPC request's NaN is (_not_finite), rather than left as a character offset.
_MAYBE_NOT_FINITE = ("unexpected character", "no digit after sign", "number is infinity")


def _not_finite_number(data: bytes) -> tuple[str, str] | None:
    """The path of the first number of `data` that JSON cannot pass on as a double (NaN, Infinity, 1e309, an integer
    beyond a double's range) and how it reads, or None when the document holds none (a bare NaN has no path) or does
    not read."""
    for node, path in _in_order(data):
        if path and isinstance(node, float) and not math.isfinite(node):
            if math.isnan(node):
                return path, "NaN"
            return path, f"{'-' if node < 0 else ''}Infinity (or a number beyond a double's range, such as 1e309)"
        if path and isinstance(node, _LongInteger):
            return path, f"an integer of {node.digits} digits, beyond a double's range"
        if path and isinstance(node, int) and not isinstance(node, bool) and abs(node) > _LARGEST_DOUBLE:
            return path, f"an integer of {len(str(abs(node)))} digits, beyond a double's range"
    return None


class _LongInteger:
    """An integer written with more digits than Python converts (sys.get_int_max_str_digits(), 4,300), kept as its
    digit count: it is far beyond a double, and reading it as an int would refuse the whole document."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _integer(text: str) -> int | _LongInteger:
    """The json module's integer, or a _LongInteger where int() would refuse it (ValueError)."""
    try:
        return int(text)
    except ValueError:
        return _LongInteger(text)


_LARGEST_DOUBLE = 1.7976931348623157e308


_SURROGATE = re.compile("[\ud800-\udfff]")


def _broken_string(text: str) -> str | None:
    """The path of the first string of the JSON `text` holding a lone surrogate (an escaped one, or a byte that is
    not UTF-8 decoded with surrogateescape), which the json module reads as it is; "" for a member's name at the top,
    None when the text holds none or does not read. The path stops at an object whose member name is broken: a param
    must be text (orjson writes no lone surrogate)."""
    for node, path in _in_order(text):
        if isinstance(node, str) and _SURROGATE.search(node):
            return path
        if isinstance(node, dict) and any(_SURROGATE.search(name) for name in node):
            return path
    return None


def _in_order(document: str | bytes) -> Iterator[tuple[Json, str]]:
    """Each value of the JSON `document` with its path, in the order they are written (nothing when it does not
    read with Python's json module, which the error paths above use: it reads what orjson refuses)."""
    try:
        stack: list[tuple[Json, str]] = [(json.loads(document, parse_int=_integer), "")]
    except (ValueError, RecursionError):
        return
    while stack:
        node, path = stack.pop()
        yield node, path
        if isinstance(node, dict):
            stack.extend((value, join(path, name)) for name, value in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))


# JSON nesting below the body's object. As deep as the typed gRPC requests decode (their Struct values take two
# messages a level, within protobuf's limit of 100), so REST and gRPC callers meet one rule; a JSON schema of a dozen
# nested objects is ~28 levels.
MAX_DEPTH = 32
_NAMED_DEPTH = 3  # the param names the field this deep (`messages[0].content`), not the whole way down
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')


def _deeper_than(data: bytes, limit: int) -> bool:
    """Whether the well-formed JSON text `data` nests containers more than `limit` levels below its top one, at C
    speed (a walk of the parsed body costs twice as much): escaped quotes and backslashes out, then all but brackets
    and quotes, then the strings between the quotes; what is left is brackets alone, peeled one level a pass."""
    skeleton = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_AS_BRACKETS, _NOT_STRUCTURE)
    if b'"' in skeleton:
        skeleton = b"".join(skeleton.split(b'"')[::2])
    for _ in range(limit + 1):
        if not skeleton:
            return False
        skeleton = skeleton.replace(b"[]", b"")
    return bool(skeleton)


def _nested_too_deeply(body: dict[str, Json]) -> str | None:
    """The path of a field holding values nested more than MAX_DEPTH deep, else None (iterative: no recursion)."""
    stack: list[tuple[Json, str, int]] = [(body, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return path
        named = depth < _NAMED_DEPTH
        if isinstance(node, dict):
            stack.extend((v, join(path, k) if named else path, depth + 1)
                         for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]" if named else path, depth + 1)
                         for i, v in enumerate(node) if isinstance(v, (dict, list)))
    return None


def model_of(body: Mapping[str, Json]) -> str:
    """The body's `model` ("" when absent: the pipeline answers that one)."""
    return opt_string(body, "model") or ""


def body_and_model(data: bytes | Message) -> tuple[dict[str, Json], str]:
    """A REST caller's raw body (parsed) or a typed request (turned into the same JSON), and its `model`."""
    body = parse_body(data) if isinstance(data, bytes) else proto_to_json(data)
    return body, model_of(body)


def type_name(value: Json) -> str:
    return _TYPE_NAMES.get(type(value), "a value")


def wrong_type(param: str, expected: str, value: Json) -> InvalidRequest:
    return InvalidRequest(f"`{param}` must be {expected}, got {type_name(value)}.", param=param)


def no_tools_to_call() -> InvalidRequest:
    """A tool_choice that demands a call (`required`, Anthropic's `any`) in a request without tools: both APIs refuse
    it, so it is refused before any model, never dropped on the way to the other dialect."""
    return InvalidRequest("`tool_choice` demands a tool call, but the request has no `tools`.", param="tool_choice")


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def is_number(value: Json) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value: Json) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _typed(obj: Mapping, name: str, path: str, check, expected: str):
    """A member of the JSON type `check` accepts; absent or null is None."""
    value = obj.get(name)
    if value is None or check(value):
        return value
    raise wrong_type(join(path, name), expected, value)


def opt_string(obj: Mapping, name: str, path: str = "") -> str | None:
    return _typed(obj, name, path, lambda v: isinstance(v, str), "a string")


def opt_bool(obj: Mapping, name: str, path: str = "") -> bool | None:
    return _typed(obj, name, path, lambda v: isinstance(v, bool), "a boolean")


def opt_object(obj: Mapping, name: str, path: str = "") -> dict | None:
    return _typed(obj, name, path, lambda v: isinstance(v, dict), "an object")


def opt_array(obj: Mapping, name: str, path: str = "") -> list | None:
    return _typed(obj, name, path, lambda v: isinstance(v, list), "an array")


def opt_number(obj: Mapping, name: str, low: float, high: float, path: str = "") -> float | None:
    """A number in [low, high]; absent or null is None."""
    value = obj.get(name)
    if value is None:
        return None
    param = join(path, name)
    if not is_number(value):
        raise wrong_type(param, "a number", value)
    if not low <= value <= high:
        # The value as sent (repr: its shortest exact form): `:g` wrote 2.0000001 as "2", which reads as allowed.
        raise InvalidRequest(f"`{param}` must be between {low:g} and {high:g}, got {value!r}.", param=param)
    return value


def opt_int(obj: Mapping, name: str, low: int, high: int = 2**63 - 1, path: str = "") -> int | None:
    """An integer in [low, high] (a whole float such as 5.0 counts); absent or null is None."""
    value = obj.get(name)
    if value is None:
        return None
    param = join(path, name)
    if not is_integer(value):
        raise wrong_type(param, "an integer", value)
    # As sent: 1e308 is "1e+308", not the 309 digits of int(1e308).
    if value < low:
        raise InvalidRequest(f"`{param}` must be at least {low}, got {value!r}.", param=param)
    if value > high:
        raise InvalidRequest(f"`{param}` must be at most {high}, got {value!r}.", param=param)
    return int(value)


def text_parts(value: Json, param: str, *, part_types: tuple[str, ...] | None = ("text",),
               text_members: Mapping[str, str] = TEXT_PARTS) -> tuple[str, list[int]]:
    """A string, or a list of content parts [{"type": "text", "text": ...}], as one string; null is "".

    `text_members` names the parts read as text and the member holding it. Returns the text and the indexes of the
    other parts: of the kinds `part_types` lists (e.g. images), or of any kind when it is None (an API that adds
    kinds). The internal values do not hold those: only an upstream of the caller's dialect can be given them."""
    if isinstance(value, str):
        return value, []
    if value is None:
        return "", []
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of content parts", value)
    texts, other = [], []
    for i, part in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise wrong_type(where, "an object with a `type`", part)
        opt_object(part, "cache_control", where)  # not read, but still type-checked
        kind = part.get("type")
        if isinstance(kind, str) and kind in text_members:
            member = text_members[kind]
            text = part.get(member)
            if not isinstance(text, str):
                raise wrong_type(f"{where}.{member}", "a string", text)
            texts.append(text)
        elif isinstance(kind, str) and (part_types is None or kind in part_types):
            other.append(i)
        elif part_types is None:
            raise wrong_type(f"{where}.type", "a string", kind)
        else:
            raise InvalidRequest(f"`{where}.type` must be one of {', '.join(part_types)}; got {shown(kind)}.",
                                 param=f"{where}.type")
    return "\n".join(texts), other


def string_list(value: Json, param: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings (e.g. `stop`), as a tuple; null is ()."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise wrong_type(param, "a string or an array of strings", value)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            where = param if isinstance(value, str) else f"{param}[{i}]"
            raise InvalidRequest(f"`{where}` must be a non-empty string.", param=where)
    return tuple(items)


def shown(value: Json) -> str:
    """A caller's value for an error message: a string quoted and cut short, anything else by its JSON type."""
    return repr(value[:40]) if isinstance(value, str) else type_name(value)


def proto_to_json(message: Message) -> dict[str, Json]:
    """A typed request as the JSON body a REST caller would have sent (wire names, unset fields absent), for the
    same validation and passthrough as a raw body.

    json_format prints 64-bit integers as strings (the proto3 JSON rule) and numbers inside Structs as floats; both
    are put back, so an upstream sees `"seed": 7` and a schema's `"minimum": 1`, as the caller wrote them.

    A typed request can hold NaN or Infinity, which JSON cannot: json_format refuses one in a Value and prints one
    in a double field as a string ("NaN"), so either is a 400 naming it, as a REST body's is.
    """
    refuse_undeclared(message)
    try:
        body = _integral(json_format.MessageToDict(message, preserving_proto_field_name=True))
    except json_format.SerializeToJsonError:
        raise _not_finite(message) from None
    for field in message.DESCRIPTOR.fields:
        if field.name not in body:
            continue
        if field.type in _INT64_TYPES and not field.is_repeated:
            body[field.name] = int(body[field.name])
        elif field.cpp_type in _FLOAT_TYPES or _holds_floats(field):  # the typed requests' doubles are all here
            value = body[field.name]
            if isinstance(value, str) or isinstance(value, dict) and any(isinstance(v, str) for v in value.values()):
                raise _not_finite(message)
    return body


_INT64_TYPES = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)
_FLOAT_TYPES = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)
# Their fields are JSON values themselves: a path through them names JSON members, not their proto fields.
JSON_VALUES = ("google.protobuf.Value", "google.protobuf.Struct", "google.protobuf.ListValue")


def _holds_floats(field: FieldDescriptor) -> bool:
    """A map whose values are doubles (`logit_bias`)."""
    entry = field.message_type
    return (entry is not None and entry.GetOptions().map_entry
            and entry.fields_by_name["value"].cpp_type in _FLOAT_TYPES)


def _not_finite(message: Message) -> InvalidRequest:
    where, value = _first_not_finite(message) or ("", math.nan)
    shown = {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, "NaN")
    if not where:
        return InvalidRequest(f"A number in the request is {shown}: numbers must be finite.")
    return InvalidRequest(f"`{where}` must be a finite number, got {shown}.", param=where)


def _first_not_finite(message: Message, path: str = "") -> tuple[str, float] | None:
    """The path (`logit_bias.5`, `tools[0].function.parameters.minimum`) and value of the first NaN or Infinity."""
    for where, field, item in _items(message, path):
        if field.cpp_type in _FLOAT_TYPES and not math.isfinite(item):
            return where, item
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and (found := _first_not_finite(item, where)):
            return found
    return None


def refuse_undeclared(message: Message) -> None:
    """A typed request holding fields this gateway's .proto files do not declare (from a stub generated from newer
    files) is refused: json_format would drop them without a word, and their names, which an upstream would need,
    are unknown here. Checked at C speed on a copy (~5 µs for a small request); only one that has some is walked."""
    known = type(message)()
    known.CopyFrom(message)
    size = known.ByteSize()
    known.DiscardUnknownFields()
    if known.ByteSize() == size:
        return
    where, numbers, name = _first_undeclared(message) or ("", [], message.DESCRIPTOR.full_name)
    holder = f"`{where}`" if where else "The request"
    raise InvalidRequest(f"{holder} holds field number {', '.join(map(str, numbers))}, which this gateway's {name} "
                         "does not declare (a stub generated from newer .proto files?): it is refused, not dropped.",
                         param=where or None)


def _first_undeclared(message: Message, path: str = "") -> tuple[str, list[int], str] | None:
    """The path of the first message holding undeclared fields, their numbers and the message's type."""
    if numbers := [field.field_number for field in unknown_fields.UnknownFieldSet(message)]:
        return path, numbers, message.DESCRIPTOR.full_name
    for where, field, item in _items(message, path):
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and (found := _first_undeclared(item, where)):
            return found
    return None


def _items(message: Message, path: str):
    """(path, field, value) for each value set in `message`: a repeated field's items and a map's values each on
    their own, with their JSON paths (`messages[2]`, `logit_bias.5`)."""
    json_value = message.DESCRIPTOR.full_name in JSON_VALUES
    for field, value in message.ListFields():
        here = path if json_value else join(path, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            item_field = field.message_type.fields_by_name["value"]
            yield from ((f"{here}.{key}", item_field, item) for key, item in value.items())
        elif field.is_repeated:
            yield from ((f"{here}[{i}]", field, item) for i, item in enumerate(value))
        else:
            yield here, field, value


def _integral(value):
    """Whole floats back to ints, all the way down (google.protobuf.Value keeps every number as a double)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


# What reading an upstream's JSON value of the wrong type raises (a list as a dict key, int("many"), .get on a
# string, ...): the readers of upstream answers turn it into an UpstreamError.
MALFORMED = (AttributeError, KeyError, TypeError, ValueError, OverflowError)


def upstream_label(value: Json, limit: int = 64) -> str:
    """A short word from an upstream's answer kept for telemetry (a finish reason; with a larger `limit`, an id or a
    model name): "" unless a string, and bounded, whatever the upstream sent."""
    return value[:limit] if isinstance(value, str) else ""


def upstream_string(value: Json) -> str:
    """`value` from an upstream's answer where text belongs; anything else is one of MALFORMED."""
    if not isinstance(value, str):
        raise TypeError(f"not a string: {type(value).__name__}")
    return value
