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


FORMAT_NAME = "output"  # the `json_schema.name` an OpenAI-compatible upstream is sent for `output_config.format`
# Anthropic's `output_config.effort` -> chat's `reasoning_effort`: the three every reasoning server takes (vLLM's and
# llama.cpp's refuse `xhigh` and `max`), as thinking budgets map (server/translate/thinking.py).
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_CONFIG_MEMBERS = ("format", "effort")


def messages_output(body: Mapping[str, Json], unread: list[Unread]) -> tuple[OutputFormat | None, str | None]:
    """A Messages request's `output_config` (type-checked already) as the JSON output and the `reasoning_effort` an
    OpenAI-compatible upstream is sent. What it cannot be sent (a format other than a json_schema with an object
    schema, an effort not among Anthropic's, members added later) is listed in `unread` for that upstream only: an
    Anthropic one judges it, and the embedded model refuses any `output_config` by its field rule."""
    config = body.get("output_config")
    if not isinstance(config, dict):
        return None, None
    unread += [Unread(f"output_config.{name}", f"`output_config.{name}` is not supported by this model.",
                      embedded=False) for name in config if name not in _CONFIG_MEMBERS]
    output_format = None
    form = config.get("format")
    if isinstance(form, dict) and form.get("type") == "json_schema" and isinstance(form.get("schema"), dict):
        output_format = OutputFormat(schema=form["schema"])
    elif form is not None:
        unread.append(_format_unread(form))
    effort = config.get("effort")
    if effort is not None and not (isinstance(effort, str) and effort in _EFFORTS):
        unread.append(Unread("output_config.effort", f"`output_config.effort` {shown(effort)} is not supported by "
                             f"this model; supported: {', '.join(_EFFORTS)}.", embedded=False))
    return output_format, _EFFORTS.get(effort) if isinstance(effort, str) else None


def _format_unread(form: Json) -> Unread:
    if not isinstance(form, dict):
        return Unread("output_config.format", f"`output_config.format` must be an object, got {shown(form)}.",
                      embedded=False)
    if form.get("type") != "json_schema":
        return Unread("output_config.format.type", f"`output_config.format` of type {shown(form.get('type'))} is not "
                      "supported by this model.", embedded=False)
    return Unread("output_config.format.schema", "`output_config.format.schema` must be an object.", embedded=False)


def messages_format_param(rest: str) -> str:
    """The Messages field an OpenAI-compatible upstream's error about `response_format` (`rest`: the path after it)
    is about: the schema (and the path inside it) is `output_config.format.schema`, anything else the format."""
    inside = ".json_schema.schema"
    if rest == inside or rest.startswith((inside + ".", inside + "[")):
        return "output_config.format.schema" + rest.removeprefix(inside)
    return "output_config.format"
