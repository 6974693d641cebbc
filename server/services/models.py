"""ModelService: the models the calling key may use, each with the path it must be called through."""

from __future__ import annotations

from portico.v1 import model_pb2, model_service_pb2_grpc

from server.domain import ModelEntry
from server.pipeline import Pipeline


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def ListModels(self, request, context) -> model_pb2.ListModelsResponse:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        models = [_model_pb(entry) for entry in self._pipeline.catalog.visible_to(key)]
        return model_pb2.ListModelsResponse(object="list", data=models)

    async def GetModel(self, request, context) -> model_pb2.Model:
        key = await self._pipeline.authenticator.authenticate(context.invocation_metadata(), allow_x_api_key=True)
        return _model_pb(self._pipeline.catalog.find(key, request.model))


def _model_pb(entry: ModelEntry) -> model_pb2.Model:
    return model_pb2.Model(
        id=entry.id, object="model", created=entry.created, owned_by=entry.owned_by, endpoint=entry.endpoint
    )
