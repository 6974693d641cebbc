"""MessageService: Anthropic-dialect messages, an adapter over the dialect servicer base, and their token count."""

from __future__ import annotations

from google.api import httpbody_pb2
from google.protobuf.message import Message

from portico.v1 import message_pb2, message_service_pb2_grpc, message_tokens_pb2
from server.domain import Endpoint
from server.domain_answers import TokenCount
from server.errors import error_object
from server.render import anthropic_error_frame, anthropic_frames, json_body
from server.services.dialect import DialectServicer
from server.translate import internal_to_anthropic as to_anthropic
from server.translate.anthropic_to_internal import count_request, message_request


class MessageServicer(DialectServicer, message_service_pb2_grpc.MessageServiceServicer):
    endpoint = Endpoint.MESSAGES
    response_type = message_pb2.Message
    event_type = message_pb2.MessageStreamEvent
    id_prefix = "msg_"
    allow_x_api_key = True

    def plan(self, body, call, *, stream):
        return message_request(body, stream=stream,
                               beta=beta_values(call.context.invocation_metadata()))

    def keeps_upstream_id(self, plan):
        return isinstance(plan.generation.source.body.get("thread"), dict)  # only an Anthropic upstream takes one

    def answer(self, header, completion, plan):
        # The reasoning of an upstream of the other dialect, shown as Anthropic's API shows thinking: when asked for.
        return to_anthropic.message(header, completion, thinking=_thinking(plan))

    def stream_objects(self, header, events, plan):
        return to_anthropic.message_events(header, events, thinking=_thinking(plan))

    frames = staticmethod(anthropic_frames)

    def error_frame(self, error):
        return anthropic_error_frame(error_object(error, anthropic=True))

    CreateMessage = DialectServicer.unary
    StreamMessage = DialectServicer.typed_stream
    CreateMessageHttp = DialectServicer.http_body
    CreateMessageHttpUnary = DialectServicer.http_unary

    async def CountMessageTokens(self, request, context) -> message_tokens_pb2.MessageTokensCount:
        count = await self._count(request, context)
        return message_tokens_pb2.MessageTokensCount(input_tokens=count.input_tokens)

    async def CountMessageTokensHttp(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        count = await self._count(request.data, context)
        return httpbody_pb2.HttpBody(content_type="application/json", data=json_body(to_anthropic.token_count(count)))

    async def _count(self, data: bytes | Message, context) -> TokenCount:
        """The same key, model and body checks as a message (the model must be served at /v1/messages)."""
        body, model, key = await self._pipeline.read_body(context, data, allow_x_api_key=True)
        call = await self._pipeline.begin(context, key, model, self.endpoint)
        request = count_request(body, beta=beta_values(context.invocation_metadata()))
        return await self._pipeline.count_tokens(call, request)


def _thinking(plan) -> bool:
    """The caller asked for thinking (enabled or adaptive): not only an effort."""
    return plan.generation.reasoning is not None and plan.generation.reasoning.shown


def beta_values(metadata) -> tuple[str, ...]:
    """The `anthropic-beta` header's values (comma-separated, possibly repeated), for an Anthropic upstream."""
    return tuple(value.strip() for name, values in metadata or () if name == "anthropic-beta"
                 for value in values.split(",") if value.strip())
