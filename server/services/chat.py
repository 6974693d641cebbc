"""ChatService: OpenAI-dialect chat completions, an adapter over the dialect servicer base."""

from __future__ import annotations

from portico.v1 import chat_pb2, chat_service_pb2_grpc
from server.domain import Endpoint
from server.errors import error_object
from server.pipeline import Pipeline
from server.render import openai_error_frame, openai_frames
from server.services.dialect import DialectServicer
from server.translate import internal_to_openai as to_openai
from server.translate.openai_to_internal import chat_request


class ChatServicer(DialectServicer, chat_service_pb2_grpc.ChatServiceServicer):
    endpoint = Endpoint.CHAT
    response_type = chat_pb2.ChatCompletion
    event_type = chat_pb2.ChatCompletionChunk
    id_prefix = "chatcmpl-"

    def __init__(self, pipeline: Pipeline, *, default_max_tokens: int) -> None:
        super().__init__(pipeline)
        self._default_max_tokens = default_max_tokens

    def plan(self, body, call, *, stream):
        return chat_request(body, default_max_tokens=self._default_max_tokens, stream=stream)

    def answer(self, header, completion, plan):
        return to_openai.chat_completion(header, completion)

    def stream_objects(self, header, events, plan):
        return to_openai.chat_chunks(header, events, include_usage=plan.include_usage)

    frames = staticmethod(openai_frames)
    typed = staticmethod(to_openai.typed_reasoning)

    def error_frame(self, error):
        return openai_error_frame(error_object(error))

    CreateChatCompletion = DialectServicer.unary
    StreamChatCompletion = DialectServicer.typed_stream
    CreateChatCompletionHttp = DialectServicer.http_body
    CreateChatCompletionHttpUnary = DialectServicer.http_unary
