"""JSON response bodies."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from server.domain import Json


def json_body(payload: Mapping[str, Json]) -> bytes:
    """orjson: integers stay integers and non-ASCII text is written as UTF-8, as the official APIs answer."""
    return orjson.dumps(payload)
