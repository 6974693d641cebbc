"""ModelService: the models the calling key may use, each with the path it must be called through; and
AnthropicModelService: the same in the Anthropic API's shape, with its paging (Envoy sends the anthropic SDK there).

A typed request holding a field these .proto files do not declare (a stub generated from newer ones: a filter added
later) is refused, as on every typed RPC: dropped, the caller would read every model as the filtered answer. REST
reaches these RPCs through Envoy's transcoder, which makes no such field."""

from __future__ import annotations

from datetime import datetime, timezone

from google.protobuf import struct_pb2
from portico.v1 import (anthropic_model_pb2, anthropic_model_service_pb2_grpc, model_pb2,
                        model_service_pb2_grpc)

from server.catalog.pages import model_page
from server.domain_models import ModelEntry
from server.pipeline import Pipeline
from server.translate.values import refuse_undeclared


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def ListModels(self, request, context) -> model_pb2.ListModelsResponse:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        refuse_undeclared(request)
        models = [_model_pb(entry) for entry in self._pipeline.catalog.visible_to(key)]
        return model_pb2.ListModelsResponse(object="list", data=models)

    async def GetModel(self, request, context) -> model_pb2.Model:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        refuse_undeclared(request)
        return _model_pb(self._pipeline.catalog.find(key, request.model))


class AnthropicModelServicer(anthropic_model_service_pb2_grpc.AnthropicModelServiceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def ListAnthropicModels(self, request, context) -> anthropic_model_pb2.ListAnthropicModelsResponse:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        refuse_undeclared(request)
        limit = request.limit if request.HasField("limit") else None
        page = model_page(self._pipeline.catalog.visible_to(key), limit=limit, after_id=request.after_id,
                          before_id=request.before_id, lifecycle=request.lifecycle)
        ids = [entry.id for entry in page.models]
        return anthropic_model_pb2.ListAnthropicModelsResponse(
            data=[_anthropic_model_pb(entry) for entry in page.models], has_more=page.has_more,
            first_id=_string_or_null(ids[0] if ids else None), last_id=_string_or_null(ids[-1] if ids else None))

    async def GetAnthropicModel(self, request, context) -> anthropic_model_pb2.AnthropicModel:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        refuse_undeclared(request)
        return _anthropic_model_pb(self._pipeline.catalog.find(key, request.model_id))


def _model_pb(entry: ModelEntry) -> model_pb2.Model:
    return model_pb2.Model(
        id=entry.id, object="model", created=entry.created, owned_by=entry.owned_by, endpoint=entry.endpoint
    )


def _anthropic_model_pb(entry: ModelEntry) -> anthropic_model_pb2.AnthropicModel:
    created_at = datetime.fromtimestamp(entry.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return anthropic_model_pb2.AnthropicModel(
        type="model", id=entry.id, display_name=entry.id, created_at=created_at, lifecycle="active",
        endpoint=entry.endpoint,
    )


def _string_or_null(text: str | None) -> struct_pb2.Value:
    return struct_pb2.Value(string_value=text) if text is not None else struct_pb2.Value(null_value=0)
