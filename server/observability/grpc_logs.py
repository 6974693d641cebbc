"""grpc's own log lines must not carry request metadata (operations.md, Logs: no key in any log at any level).

grpc-core logs a metadata value it cannot decode as UTF-8 whole, with a traceback, three times per call:
`Invalid encoding on b'Bearer pk-caf\\xe9-...'`. Such a value is an API key as often as not (a Latin-1 byte from a
browser), so every bytes argument of a line of grpc's logger is replaced by its length: the fact stays, the value
goes. Envoy refuses such keys before they reach the server (gateway/lua/request.lua); this covers native gRPC
callers, whose metadata Envoy passes through untouched.
"""

from __future__ import annotations

import logging

GRPC_LOGGER = "grpc._cython.cygrpc"


class MetadataRedaction(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(arg, (bytes, bytearray)) for arg in record.args):
            record.args = tuple(f"a value of {len(arg)} bytes (redacted)" if isinstance(arg, (bytes, bytearray))
                                else arg for arg in record.args)
            # The traceback says only where decoding failed, three times per call: noise a client could flood.
            record.exc_info, record.exc_text = None, None
        return True


def redact_grpc_metadata_logs() -> None:
    """Install the filter on grpc's logger, once per process (each server start calls this)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, MetadataRedaction) for f in logger.filters):
        logger.addFilter(MetadataRedaction())
