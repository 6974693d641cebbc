"""JSON response bodies."""

from __future__ import annotations

from collections.abc import Mapping

from server import wire_json
from server.domain import Json


def json_body(payload: Mapping[str, Json]) -> bytes:
    """Integers stay integers and non-ASCII text is written as UTF-8, as the official APIs answer."""
    return wire_json.dumps(payload)
