"""The error table lives in server/errors.py alone: Envoy's Lua shaper, docs/api.md and the Python client follow it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from portico.client import APIError, InternalServerError, error_from_http

from gateway.envoy import lua_source, render_lua, repo_root
from server.errors import TABLE, kind_by_status

LUA = lua_source(repo_root() / "gateway" / "lua")
CALLER_STATUSES = sorted({kind.http_status for kind in TABLE} - {499})  # 499: the caller has gone


def test_every_status_has_one_default_row_with_a_message():
    statuses = {kind.http_status for kind in TABLE}
    assert set(kind_by_status()) == statuses
    assert {408, 413, 426, 431, 502} <= statuses
    assert all(kind.message and kind.message.isascii() for kind in TABLE)
    assert kind_by_status()[404].code == "not_found"  # unknown URLs are not models


def test_the_lua_shaper_gets_every_row_of_the_table():
    rendered = render_lua(LUA, {}, {}, {})
    rows = dict(re.findall(r'\[(\d{3})\] = \{"(\w+)"', rendered))
    assert rows == {str(status): kind.code for status, kind in kind_by_status().items()}
    assert "@KINDS@" not in rendered


def test_the_lua_source_has_no_table_of_its_own():
    assert not re.search(r"\[\d{3}\] = \{", LUA), "statuses belong in server/errors.py"
    with pytest.raises(ValueError):
        render_lua("local KINDS = {[400] = {}}", {}, [], {})


def test_docs_api_lists_every_row():
    text = (Path(repo_root()) / "docs" / "api.md").read_text()
    table = text[text.index("## Errors"):]
    for kind in TABLE:
        row = f"| {kind.http_status} | {kind.grpc_code.name} | `{kind.code}` | `{kind.type}` |"
        assert row in table, f"docs/api.md's error table lacks {row}"


@pytest.mark.parametrize("status", CALLER_STATUSES)
def test_the_client_has_a_class_for_every_status(status):
    kind = kind_by_status()[status]
    body = f'{{"error": {{"message": "m", "type": "{kind.type}", "param": null, "code": "{kind.code}"}}}}'.encode()
    error = error_from_http(status, body, {})
    assert isinstance(error, APIError) and error.status == status
    assert type(error) is not APIError and (status == 500 or not isinstance(error, InternalServerError))
    # Without a body, the class's defaults are the row's (for a status with one row; 400 covers 408/413/426/431).
    bare = error_from_http(status, b"", {})
    if type(bare).default_status == status:
        assert (bare.code, bare.type) == (kind.code, kind.type)
