"""ImageService: OpenAI-dialect image generation, and the signed links its `url` answers point at."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import grpc
from google.api import httpbody_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from portico.v1 import image_pb2, image_service_pb2_grpc
from server.domain import Endpoint
from server.errors import UpstreamError
from server.image_store import ImageStore
from server.pipeline import Pipeline
from server.render import json_body
from server.translate.openai_images import image_request, images_response

CONTENT_PIECE_BYTES = 1024 * 1024
# The largest message the server sends (server/app.py's grpc option): multi-megabyte base64 images.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ImageServicer(image_service_pb2_grpc.ImageServiceServicer):
    def __init__(self, pipeline: Pipeline, store: ImageStore) -> None:
        self._pipeline = pipeline
        self._store = store

    async def _generate(self, data: bytes | Message, context: grpc.aio.ServicerContext) -> dict:
        """`data`: a REST caller's raw body, or a typed request."""
        body, model, key = await self._pipeline.read_body(context, data)
        call = await self._pipeline.begin(context, key, model, Endpoint.IMAGES)
        plan = image_request(body)
        answer = await self._pipeline.generate_images(call, plan.generation)
        urls = await self._store.put(answer.images) if plan.response_format == "url" else None
        return images_response(int(time.time()), plan, answer, urls)

    async def CreateImage(self, request, context) -> image_pb2.ImagesResponse:
        body = await self._generate(request, context)
        usage = body.pop("usage", None)
        # What the message has no field for is left out, as in the other typed answers.
        response = json_format.ParseDict(body, image_pb2.ImagesResponse(), ignore_unknown_fields=True)
        if usage is not None and (typed := _typed_usage(usage)) is not None:
            response.usage.CopyFrom(typed)
        if (size := response.ByteSize()) > MAX_MESSAGE_BYTES:  # else grpc fails the call with its own words only
            error = UpstreamError(f"The images are {size / 2**20:.1f} MiB as one gRPC answer, more than the "
                                  f"{MAX_MESSAGE_BYTES >> 20} MiB the server sends: ask for `response_format: url` "
                                  "(a link to each image), or for fewer images.")
            error.should_retry = False  # the same request would be drawn, billed and too big again
            raise error
        return response

    async def CreateImageHttp(self, request, context) -> AsyncIterator[httpbody_pb2.HttpBody]:
        # In pieces, which Envoy joins for REST callers: ten big images as base64 pass the largest message.
        for piece in _pieces(json_body(await self._generate(request.data, context)), "application/json"):
            yield piece

    async def GetImageContent(self, request, context) -> AsyncIterator[httpbody_pb2.HttpBody]:
        # No API key on purpose: the link's signature and expiry are the credential (see server/image_store.py).
        image = await self._store.get(request.name, request.expires, request.signature)
        # A link's bytes never change: its caller may keep them until it expires, but no shared cache (the link is
        # the only credential) nor any cache past the link's end.
        await context.send_initial_metadata(
            (("cache-control", f"private, max-age={image.expires_in}, immutable"),))
        # In pieces: grpc clients refuse messages over 4 MiB by default, and an upstream's image can be bigger.
        for piece in _pieces(image.data, image.content_type):
            yield piece


def _typed_usage(usage: dict) -> image_pb2.ImageUsage | None:
    """An upstream's `usage` where it has OpenAI's shape; else none (a REST answer passes on whatever was sent)."""
    try:
        return json_format.ParseDict(usage, image_pb2.ImageUsage(), ignore_unknown_fields=True)
    except json_format.ParseError:
        return None


def _pieces(data: bytes, content_type: str) -> Iterator[httpbody_pb2.HttpBody]:
    """`data` as HttpBody messages of at most CONTENT_PIECE_BYTES (one, empty, for no data)."""
    for start in range(0, max(len(data), 1), CONTENT_PIECE_BYTES):
        yield httpbody_pb2.HttpBody(content_type=content_type, data=data[start:start + CONTENT_PIECE_BYTES])
