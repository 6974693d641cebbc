"""The check a tool call's streamed arguments pass on their way to a Messages caller: still the beginning of one JSON
object (server/translate/json_prefix.py), as the anthropic SDK needs them to be after every piece."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.translate.json_prefix import JsonObjectPrefix

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=15)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(), VALUES), st.booleans(), st.booleans(), st.integers(1, 6))
def test_every_beginning_of_an_object_is_accepted(value, indent, ascii_only, size):
    text = json.dumps(value, indent=2 if indent else None, ensure_ascii=ascii_only)
    arguments = JsonObjectPrefix()
    assert all(arguments.feed(text[i:i + size]) for i in range(0, len(text), size))


@pytest.mark.parametrize("text", [
    '{"city": Oslo}', '{"city": "Oslo"}}', '{"a": 1}{"b": 2}', '["Oslo"]', '"Oslo"', "1", '{"a": 01}', '{"a": 1,}',
    '{"a" 1}', '{"a": tru}', '{"a": "\\x"}', '{"a": "\x01"}', '{"a": [1,]}', '{"a": 1.}', '{"a": -}', '{"a": 1e}',
    "{'a': 1}", '{"a": "\\u12g4"}', '{"a": NaN}',
])
def test_what_no_continuation_makes_an_object_is_refused(text):
    assert not JsonObjectPrefix().feed(text)


@pytest.mark.parametrize("text", ['  {"a": [1, 2.5e-3, -0, true, null, "\\u00e9\\n"]}  ', '{"a": {}}', "{", '{"a": 1e+',
                                  '{"a": "\\', '{"a": "\\u00', '{"a": fa', '{"a"'])
def test_what_may_still_become_an_object_is_accepted(text):
    assert JsonObjectPrefix().feed(text)


def test_a_refusal_stays():
    arguments = JsonObjectPrefix()
    assert not arguments.feed("{x") and not arguments.feed('"a": 1}')
