"""A REST caller's JSON body read strictly into a typed request message, for the admin writes.

Envoy's transcoder drops JSON fields a message does not declare and reads "5" as an integer (the proto3 JSON mapping
allows both, and the transcoder has no option to refuse them), so a misspelt limit was stored as no limit at all,
with a 200. Those RPCs take the raw body instead (google.api.HttpBody) and read it here: an unknown field at any level
is a 400 naming its path and the names the object takes, a value of the wrong JSON type a 400 naming its path. As in
the mapping, null is an absent field and the lowerCamelCase names (`allModels`) are accepted beside the proto names.

Only the field kinds those messages use are read (scalars, nested messages, repeated scalars); any other kind in a
message given here is a programming error (TypeError), which the unit tests meet first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from server.domain import Json
from server.errors import InvalidRequest
from server.translate.values import is_integer, is_number, join, parse_body, wrong_type

M = TypeVar("M", bound=Message)

_F = FieldDescriptor
_INT32, _UINT32, _INT64, _UINT64 = (-(2**31), 2**31 - 1), (0, 2**32 - 1), (-(2**63), 2**63 - 1), (0, 2**64 - 1)
_INTEGER_RANGES = {
    _F.TYPE_INT32: _INT32, _F.TYPE_SINT32: _INT32, _F.TYPE_SFIXED32: _INT32, _F.TYPE_UINT32: _UINT32,
    _F.TYPE_FIXED32: _UINT32, _F.TYPE_INT64: _INT64, _F.TYPE_SINT64: _INT64, _F.TYPE_SFIXED64: _INT64,
    _F.TYPE_UINT64: _UINT64, _F.TYPE_FIXED64: _UINT64,
}


def read_body(data: bytes, message_class: type[M], *, url: Mapping[str, Json] | None = None,
              bounds: Mapping[str, tuple[int, int]] | None = None) -> M:
    """A raw body (empty reads as `{}`: nothing to set) as `message_class`. `url`: the fields the URL gave (a key's
    `id`), set as given; the body may not name them. `bounds`: the range the API takes for an integer field (by its
    path) narrower than its wire type, named in the refusal of a value beyond either (not the type's range)."""
    body = parse_body(data) if data.strip() else {}
    if body:
        _refuse_repeated(json.loads(data, object_pairs_hook=_Members.of), "")
    message = message_class(**(url or {}))
    _fill(message, body, "", omit=frozenset(url or ()), bounds=bounds or {})
    return message


class _Members(dict):
    """A JSON object as the duplicate check reads it: `twice`, the first name it holds more than once."""

    twice: str | None = None

    @classmethod
    def of(cls, pairs: list[tuple[str, Json]]) -> _Members:
        members = cls()
        for name, value in pairs:
            if name in members and members.twice is None:
                members.twice = name
            members[name] = value
        return members


def _refuse_repeated(value: Json, path: str) -> None:
    """A name given twice in one object: the JSON parsers keep the last and drop the first without a word (a merged
    template's `"limits"` twice: the key made without the first's budget). Refused, as `allModels` beside
    `all_models` is; read with the standard parser, which can tell (these bodies are small)."""
    if isinstance(value, _Members):
        if value.twice is not None:
            where = join(path, value.twice)
            raise InvalidRequest(f"`{where}` is given twice: name each field once.", param=where)
        for name, member in value.items():
            _refuse_repeated(member, join(path, name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_repeated(item, f"{path}[{index}]")


def _fill(message: Message, obj: Mapping[str, Json], path: str, *, omit: frozenset[str] = frozenset(),
          bounds: Mapping[str, tuple[int, int]]) -> None:
    fields = [f for f in message.DESCRIPTOR.fields if f.name not in omit]
    by_name = {f.json_name: f for f in fields} | {f.name: f for f in fields}
    given: dict[str, str] = {}  # field name -> the name the caller used
    for name, value in obj.items():
        where = join(path, name)
        field = by_name.get(name)
        if field is None:
            taker = f"`{path}`" if path else "the body"
            raise InvalidRequest(f"Unknown field `{where}`: {taker} takes {', '.join(f.name for f in fields)}.",
                                 param=where)
        if field.name in given:
            raise InvalidRequest(f"`{where}` is given twice, also as `{join(path, given[field.name])}`.", param=where)
        given[field.name] = name
        if value is None:
            continue
        if field.message_type is not None and not field.is_repeated:
            if not isinstance(value, dict):
                raise wrong_type(where, "an object", value)
            nested = getattr(message, field.name)
            nested.SetInParent()  # `"limits": {}` is set, as the transcoder had it
            _fill(nested, value, where, bounds=bounds)
        elif field.is_repeated:
            if not isinstance(value, list):
                raise wrong_type(where, "an array", value)
            getattr(message, field.name).extend(_scalar(field, item, f"{where}[{i}]") for i, item in enumerate(value))
        else:
            # bounds are keyed by the fields' own names: a caller's lowerCamelCase one (graceSeconds) gets them too
            setattr(message, field.name, _scalar(field, value, where, bounds.get(join(path, field.name))))


def _scalar(field: FieldDescriptor, value: Json, where: str, bounds: tuple[int, int] | None = None) -> Json:
    if field.message_type is not None or field.type in (_F.TYPE_ENUM, _F.TYPE_BYTES):
        raise TypeError(f"{field.full_name}: {field.type} fields are not read from JSON here")
    if field.type == _F.TYPE_STRING:
        if not isinstance(value, str):
            raise wrong_type(where, "a string", value)
        return value
    if field.type == _F.TYPE_BOOL:
        if not isinstance(value, bool):
            raise wrong_type(where, "a boolean", value)
        return value
    if field.type in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
        if not is_number(value):
            raise wrong_type(where, "a number", value)
        return value
    low, high = _INTEGER_RANGES[field.type]
    if not is_integer(value):
        raise wrong_type(where, "an integer", value)
    if not low <= value <= high:
        low, high = bounds or (low, high)  # the wire type's range is not the API's: a caller would try its top next
        raise InvalidRequest(f"`{where}` must be an integer from {low} to {high}, got {value}.", param=where)
    return int(value)
