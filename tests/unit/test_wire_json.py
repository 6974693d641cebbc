"""Bodies and answers keep every number as written: orjson's reading is checked, and redone where it would round."""

from __future__ import annotations

import pytest

from server import wire_json


@pytest.mark.parametrize("number", [2**64, 2**70, -(2**63) - 1, 10**30, 2**63 - 1, -(2**63)])
def test_integers_of_any_size_stay_exact_both_ways(number):
    data = b'{"a":[1,{"b":%d}],"c":"x"}' % number
    value = wire_json.loads(data)
    assert value == {"a": [1, {"b": number}], "c": "x"} and type(value["a"][1]["b"]) is int
    assert wire_json.loads(data.decode()) == value
    assert wire_json.dumps(value) == data


def test_a_long_run_of_digits_in_a_string_changes_nothing():
    value = {"id": "call_12345678901234567890", "text": "naïve ☃", "x": 1.5e-7}
    assert wire_json.loads(wire_json.dumps(value)) == value


def test_what_orjson_refuses_is_still_refused():
    for data in (b'{"a":1E+400}', b'{"a":NaN}', b'{"a":"\xff"}', b'{"a":12345678901234567890'):
        with pytest.raises(wire_json.JSONDecodeError):
            wire_json.loads(data)


def test_keys_can_be_sorted_with_a_big_integer_inside():
    assert wire_json.dumps({"b": 2**70, "a": 1}, sort_keys=True) == b'{"a":1,"b":%d}' % 2**70


def test_a_document_deeper_than_the_json_module_goes_is_read_by_orjson_alone():
    data = b"[" * 1000 + b"12345678901234567890" + b"]" * 1000
    assert wire_json.loads(data) is not None


def test_integers_are_exact_up_to_a_doubles_range_and_refused_beyond():
    """api.md: integers exactly, "a number beyond a double's range (... or an integer of more than 309 digits) is a
    400": orjson judges every document first, and reads an integer past 64 bits as a double."""
    assert wire_json.loads(b'{"a":%d}' % 10**308) == {"a": 10**308}
    with pytest.raises(wire_json.JSONDecodeError):
        wire_json.loads(b'{"a":%d}' % 10**309)


def test_a_member_named_twice_counts_once_with_its_last_value_in_its_first_place():
    for data in (b'{"a":1,"b":2,"a":3}', b'{"a":1,"b":12345678901234567890123,"a":3}'):  # orjson, and the json module
        assert list(wire_json.loads(data).items())[0] == ("a", 3)
