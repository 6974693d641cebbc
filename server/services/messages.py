"""MessageService: Anthropic-dialect messages, an adapter over the dialect servicer base."""

from __future__ import annotations

from portico.v1 import message_pb2, message_service_pb2_grpc
from server.domain import Endpoint
from server.render import anthropic_error_frame, anthropic_frames
from server.services.dialect import DialectServicer
from server.translate import internal_to_anthropic as to_anthropic
from server.translate.anthropic_to_internal import message_request


class MessageServicer(DialectServicer, message_service_pb2_grpc.MessageServiceServicer):
    endpoint = Endpoint.MESSAGES
    response_type = message_pb2.Message
    event_type = message_pb2.MessageStreamEvent
    id_prefix = "msg_"
    allow_x_api_key = True

    def plan(self, body, call, *, always_stream):
        return message_request(body, always_stream=always_stream,
                               beta=beta_values(call.context.invocation_metadata()))

    def answer(self, header, completion):
        return to_anthropic.message(header, completion)

    def stream_objects(self, header, events, plan):
        return to_anthropic.message_events(header, events)

    frames = staticmethod(anthropic_frames)
    error_frame = staticmethod(anthropic_error_frame)

    CreateMessage = DialectServicer.unary
    StreamMessage = DialectServicer.typed_stream
    CreateMessageHttp = DialectServicer.http_body
    CreateMessageHttpUnary = DialectServicer.http_unary


def beta_values(metadata) -> tuple[str, ...]:
    """The `anthropic-beta` header's values (comma-separated, possibly repeated), for an Anthropic upstream."""
    return tuple(value.strip() for name, values in metadata or () if name == "anthropic-beta"
                 for value in values.split(",") if value.strip())
