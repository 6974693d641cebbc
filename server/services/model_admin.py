"""ModelAdminService: the whole configured catalog for operators (admin keys only)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from portico.v1 import catalog_pb2, model_admin_service_pb2_grpc
from server.domain import KeyLimits, ModelEntry
from server.keys import Authenticator
from server.services.keys import limits_to_pb

_MICRO = 1_000_000  # prices are kept in micro-dollars (server/domain.py Price)


class ModelAdminServicer(model_admin_service_pb2_grpc.ModelAdminServiceServicer):
    def __init__(self, entries: Sequence[ModelEntry], model_limits: Mapping[str, KeyLimits],
                 authenticator: Authenticator) -> None:
        # Built once: the catalog is fixed while the server runs.
        self._response = catalog_pb2.ListCatalogModelsResponse(
            models=[_model_to_pb(entry, model_limits.get(entry.id)) for entry in entries])
        self._authenticator = authenticator

    async def ListCatalogModels(self, request, context) -> catalog_pb2.ListCatalogModelsResponse:
        self._authenticator.authenticate_admin(context.invocation_metadata())
        return self._response


def _model_to_pb(entry: ModelEntry, limits: KeyLimits | None) -> catalog_pb2.CatalogModel:
    upstream = entry.provider.upstream
    price = entry.price
    return catalog_pb2.CatalogModel(
        id=entry.id, endpoint=str(entry.endpoint), owned_by=entry.owned_by, created=entry.created,
        provider=entry.provider.kind, upstream_model=upstream.model if upstream else "",
        fallbacks=entry.fallbacks,
        price=catalog_pb2.ModelPrice(input=price.input / _MICRO, output=price.output / _MICRO,
                                     cached_input=price.cached_input / _MICRO, image=price.image / _MICRO),
        limits=limits_to_pb(limits) if limits else None,
    )
