"""What OpenAI's and Anthropic's APIs refuse in a tool's definition, which an upstream of the caller's dialect judges
for itself (vLLM and llama.cpp take any tool name): Unreads, so the embedded model and an upstream of the other
dialect, which stand in for the caller's API, refuse it as that API would rather than take it and let a developer
meet the 400 only in production."""

from __future__ import annotations

import re
from collections.abc import Mapping

from server.domain import Json, Unread

_NAME = re.compile(r"[a-zA-Z0-9_-]+")
OPENAI_NAME_LIMIT = 64
OPENAI_TOOL_LIMIT = 128  # tools in one request
ANTHROPIC_NAME_LIMIT = 128


def name_unread(name: str, param: str, limit: int) -> Unread | None:
    if _NAME.fullmatch(name) and len(name) <= limit:
        return None
    return Unread(param, f"`{param}` must be 1 to {limit} letters, digits, '_' or '-' ({name[:40]!r}).")


def duplicate_unread(name: str, param: str, seen: set[str]) -> Unread | None:
    """`name` if an earlier tool has it (both APIs refuse a name used twice); `seen` gathers the names."""
    if name not in seen:
        seen.add(name)
        return None
    return Unread(param, f"`{param}`: tool names must be unique; {name[:40]!r} names an earlier tool too.")


def schema_type_unread(schema: Mapping[str, Json], param: str, *, type_required: bool) -> Unread | None:
    """Both APIs take only an object schema for a tool's input; Anthropic requires it to say so."""
    kind = schema.get("type")
    if kind == "object" or (kind is None and not type_required):
        return None
    return Unread(f"{param}.type", f"`{param}.type` must be 'object' (a tool's input is an object).")


def too_many_unread(tools: list, param: str, limit: int) -> Unread | None:
    """More tools than the caller's API takes in one request."""
    if len(tools) <= limit:
        return None
    return Unread(param, f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, but got "
                         f"an array with length {len(tools)} instead.")
