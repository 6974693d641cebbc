"""The strict JSON reader of the admin REST writes: what the proto3 JSON mapping accepts, minus unknown fields and
coerced types, with the offending path as `param`."""

from __future__ import annotations

import pytest
from portico.v1 import key_pb2

from server.errors import InvalidRequest
from server.translate.json_to_message import read_body


def refused(data: bytes, message_class=key_pb2.CreateKeyRequest, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        read_body(data, message_class, **kwargs)
    return caught.value


def test_reads_what_the_transcoder_read():
    request = read_body(b'{"name": "n", "allModels": true, "models": ["a"], "limits": {"max_spend_day": 2.5,'
                        b' "daily_tokens": 7.0}, "env": null}', key_pb2.CreateKeyRequest)
    assert request == key_pb2.CreateKeyRequest(name="n", all_models=True, models=["a"],
                                               limits=key_pb2.KeyLimits(max_spend_day=2.5, daily_tokens=7))
    assert read_body(b'{"limits": {}}', key_pb2.UpdateKeyRequest).HasField("limits")
    assert read_body(b"  ", key_pb2.RotateKeyRequest, url={"id": "key_1"}) == key_pb2.RotateKeyRequest(id="key_1")


def test_refuses_unknown_names_wrong_types_and_fields_given_twice():
    error = refused(b'{"limits": {"rpm": 1}}')
    assert error.param == "limits.rpm" and "requests_per_minute, tokens_per_minute" in str(error)
    assert refused(b'{"id": "key_2"}', key_pb2.UpdateKeyRequest, url={"id": "key_1"}).param == "id"
    assert refused(b'{"models": ["a", null]}').param == "models[1]"
    assert refused(b'{"admin": "true"}').param == "admin"
    assert refused(b'{"limits": {"daily_tokens": 1.5}}').param == "limits.daily_tokens"
    assert refused(b'{"grace_seconds": 4294967296}', key_pb2.RotateKeyRequest).param == "grace_seconds"
    assert refused(b'{"all_models": true, "allModels": false}').param == "allModels"
    assert refused(b'["name"]').param is None


def test_refuses_a_name_given_twice_at_any_level_naming_its_path():
    """The parsers keep the last of a name given twice: a body's first `limits` (a budget) was dropped unseen."""
    assert refused(b'{"limits": {"max_spend_day": 5}, "limits": {}}').param == "limits"
    assert refused(b'{"limits": {"daily_tokens": 1, "daily_tokens": 2}}').param == "limits.daily_tokens"
    assert refused(b'{"name": "a", "models": ["x"], "name": "a"}').param == "name"
    assert refused(b'{"models": ["x"], "limits": {}, "models": ["x"]}').param == "models"  # even the same value
