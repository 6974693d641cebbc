"""ModelAdminService: the whole configured catalog for operators (admin keys only), with each deployment's passive
health as it is now."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from portico.v1 import catalog_pb2, model_admin_service_pb2_grpc
from server.domain_keys import KeyLimits
from server.domain_models import Deployment, ModelEntry
from server.keys import Authenticator
from server.services.keys import limits_to_pb
from server.translate.values import refuse_undeclared
from server.usage.money import micros_to_usd

UNWATCHED = "unwatched"  # a model's only deployment: never taken out of service (server/providers/health.py)

States = Callable[[], Sequence[tuple[str, str, str]]]  # (model id, deployment name, state) of watched deployments


class ModelAdminServicer(model_admin_service_pb2_grpc.ModelAdminServiceServicer):
    def __init__(self, entries: Sequence[ModelEntry], model_limits: Mapping[str, KeyLimits],
                 authenticator: Authenticator, states: States = tuple) -> None:
        self._entries = tuple(entries)
        self._limits = model_limits
        self._authenticator = authenticator
        self._states = states

    async def ListCatalogModels(self, request, context) -> catalog_pb2.ListCatalogModelsResponse:
        await self._authenticator.authenticate_admin(context.invocation_metadata())
        refuse_undeclared(request)  # a stub generated from newer .proto files: refused, as on every typed RPC
        states = {(model, name): state for model, name, state in self._states()}
        return catalog_pb2.ListCatalogModelsResponse(
            models=[_model_to_pb(entry, self._limits.get(entry.id), states) for entry in self._entries])


def _model_to_pb(entry: ModelEntry, limits: KeyLimits | None,
                 states: Mapping[tuple[str, str], str]) -> catalog_pb2.CatalogModel:
    price = entry.price
    first = _deployment_to_pb(entry.deployments[0], "")
    return catalog_pb2.CatalogModel(
        id=entry.id, endpoint=str(entry.endpoint), owned_by=entry.owned_by, created=entry.created,
        provider=first.provider, upstream_model=first.upstream_model,
        deployments=[_deployment_to_pb(d, states.get((entry.id, d.name), UNWATCHED)) for d in entry.deployments],
        fallbacks=entry.fallbacks,
        # Prices are kept in micro-dollars (per million tokens, per image) and shown in US dollars.
        price=catalog_pb2.ModelPrice(input=micros_to_usd(price.input), output=micros_to_usd(price.output),
                                     cached_input=micros_to_usd(price.cached_input), image=micros_to_usd(price.image),
                                     cache_write=micros_to_usd(price.cache_write),
                                     cache_write_1h=micros_to_usd(price.cache_write_1h),
                                     web_search=micros_to_usd(price.web_search)),
        limits=limits_to_pb(limits) if limits else None,
    )


def _deployment_to_pb(deployment: Deployment, state: str) -> catalog_pb2.CatalogDeployment:
    # Never the upstream's address or the name of its key variable: only what identifies the model served.
    upstream = deployment.provider.upstream
    return catalog_pb2.CatalogDeployment(
        name=deployment.name, provider=deployment.provider.kind, upstream_model=upstream.model if upstream else "",
        weight=deployment.weight, state=state,
    )
