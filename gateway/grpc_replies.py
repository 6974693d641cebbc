"""Envoy's own replies to native gRPC callers, in Portico's terms (pure).

When Envoy answers a gRPC call itself (the server down or restarting, so nothing listens on its socket), it sends a
trailers-only answer whose grpc-status comes from its HTTP status (UNAVAILABLE for all of 502, 503 and 504) and whose
grpc-message is its own text ("upstream connect error or disconnect/reset before headers. ..."). Every other error
a gRPC caller gets holds the error object in its status details (api.md, Errors). These local-reply mappers, one per
row of the table at 500 or more (the replies Envoy makes to a call it has accepted), the 413 (a portico.v1
request over Envoy's 16 MiB buffer: the Lua filter holds it whole to read its framing; Envoy said UNKNOWN "Payload
Too Large") and the 408 (a request that had not all arrived within envoy.yaml's request_timeout: UNKNOWN "request
timeout"), give such an answer the row's gRPC code, message and details, rendered from server/errors.py, and the
row's portico-http-status, by which the Lua filter knows a portico.v1 call's reply for Envoy's access log. Nothing else
of the Lua filter is involved: most native calls skip it, for speed (envoy.yaml).
"""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf import any_pb2
from google.rpc import status_pb2

from portico.v1 import error_pb2
from server.errors import ErrorKind, kind_by_status

# The services whose errors have Anthropic's `type` (server/services/interceptor.py: MessageService,
# AnthropicModelService), as a gRPC :path says them.
_ANTHROPIC_PATHS = r"/portico\.v1\.(MessageService|AnthropicModelService)/.*"
# Envoy's replies below 500 to a call it holds: its request over the buffer (413), or not all arrived in time (408).
_HELD_REQUEST_STATUSES = (408, 413)


def status_details(kind: ErrorKind, *, anthropic: bool) -> str:
    """grpc-status-details-bin for `kind`: a google.rpc.Status holding the ErrorResponse, as the server sends it."""
    response = error_pb2.ErrorResponse(
        error=error_pb2.ApiError(message=kind.message, type=kind.type_for(anthropic=anthropic), code=kind.code),
        http_status=kind.http_status)
    detail = any_pb2.Any()
    detail.Pack(response)
    status = status_pb2.Status(code=kind.grpc_code.value[0], message=kind.message, details=[detail])
    return base64.b64encode(status.SerializeToString()).decode().rstrip("=")  # gRPC's binary headers: unpadded


def grpc_reply_mappers() -> list[dict[str, Any]]:
    """local_reply_config mappers for gRPC calls (content-type application/grpc...), one per 5xx row (and 408's and
    413's) and shape."""
    mappers = []
    for status, kind in sorted(kind_by_status().items()):
        if status < 500 and status not in _HELD_REQUEST_STATUSES:
            continue
        for anthropic in (True, False):  # Anthropic's paths first: the first mapper that matches is used
            filters: list[dict[str, Any]] = [
                {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                    "default_value": status, "runtime_key": f"portico.grpc_reply_{status}"}}}},
                {"header_filter": {"header": {"name": "content-type",
                                              "string_match": {"prefix": "application/grpc"}}}},
            ]
            if anthropic:
                filters.append({"header_filter": {"header": {"name": ":path", "string_match": {
                    "safe_regex": {"regex": _ANTHROPIC_PATHS}}}}})
            mappers.append({
                "filter": {"and_filter": {"filters": filters}},
                "body": {"inline_string": kind.message},  # Envoy sends a gRPC caller's body as its grpc-message
                "headers_to_add": [
                    {"header": {"key": "grpc-status", "value": str(kind.grpc_code.value[0])},
                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                    {"header": {"key": "grpc-status-details-bin", "value": status_details(kind, anthropic=anthropic)},
                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                    # The row's HTTP status, as every error's trailers carry it (api.md, gRPC); it also tells the
                    # Lua filter that Envoy made this reply, for the access log (response.lua).
                    {"header": {"key": "portico-http-status", "value": str(status)},
                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                    # A caller's id the Lua filter removed (not UTF-8) is made again by the route, which a reply
                    # before it never reaches: a new one here (response.lua copies it to request-id).
                    {"header": {"key": "x-request-id", "value": "%UNIQUE_ID%"}, "append_action": "ADD_IF_ABSENT"},
                ],
            })
    return mappers
