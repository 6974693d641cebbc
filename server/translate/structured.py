"""Structured output across dialects: chat's `response_format` and Anthropic's `output_config.format`, each read
into one OutputFormat (docs/api.md, Request bodies), and what the other dialect cannot be sent, refused by its path.

An upstream of the caller's dialect receives the caller's field whole and judges it; nothing here refuses a request
it would take. The schema is never rewritten: what the other dialect's API refuses in it (Anthropic: numeric and
string-length bounds, recursive schemas) reaches the caller as that upstream's 400, naming the caller's field.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.domain import Json, OutputFormat, Unread
from server.errors import InvalidRequest
from server.translate.values import opt_object, opt_string, shown

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SCHEMA = "response_format.json_schema.schema"


def chat_output_format(body: Mapping[str, Json], unread: list[Unread]) -> OutputFormat | None:
    """A chat request's `response_format` as the JSON output it asks for (None: text). `json_object` (any JSON
    object) has no Anthropic equivalent, and a `json_schema` without an object `schema` nothing to send Anthropic:
    listed in `unread` for an Anthropic upstream only (the embedded model refuses any JSON output by capability)."""
    response_format = opt_object(body, "response_format")
    if response_format is None:
        return None
    kind = opt_string(response_format, "type", "response_format")
    if kind is None:
        raise InvalidRequest(f"`response_format.type` must be one of {', '.join(_RESPONSE_FORMATS)}; got null.",
                             param="response_format.type")
    if kind not in _RESPONSE_FORMATS:  # a kind added later (vLLM's `structural_tag`): for an upstream of this dialect
        unread.append(Unread("response_format.type", f"`response_format` of type {shown(kind)} is not supported by "
                                                     "this model."))
        return None
    if kind == "text":
        return None
    if kind == "json_object":
        unread.append(Unread("response_format.type", "`response_format` of type 'json_object' is not supported by "
                             "this model (Anthropic's API takes a JSON schema only): send a 'json_schema'.",
                             embedded=False))
        return OutputFormat()
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict):
        unread.append(Unread("response_format.json_schema", "`response_format.json_schema` must be an object holding "
                             "the `schema` on this model.", embedded=False))
    elif not isinstance(schema, dict):
        unread.append(Unread(_SCHEMA, f"`{_SCHEMA}` must be an object on this model (Anthropic's API takes a JSON "
                             f"schema only), got {shown(schema) if schema is not None else 'none'}.", embedded=False))
    return OutputFormat(schema=schema if isinstance(schema, dict) else None)


def chat_format_param(path: list[str]) -> str:
    """The chat field an Anthropic error about `output_config` (`path`: the members after it) is about: the schema
    (and the path inside it) is `response_format.json_schema.schema`, anything else `response_format`."""
    if path[:2] == ["format", "schema"]:
        return ".".join([_SCHEMA, *path[2:]])
    return "response_format"
