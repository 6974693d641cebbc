"""KeyService: key administration over gRPC, for admin keys only."""

from __future__ import annotations

from portico.v1 import key_pb2, key_service_pb2_grpc
from server.domain import KEY_LIMIT_NAMES, ApiKey, KeyLimits
from server.keys import Authenticator, KeyStore


class KeyServicer(key_service_pb2_grpc.KeyServiceServicer):
    def __init__(self, store: KeyStore, authenticator: Authenticator) -> None:
        self._store = store
        self._authenticator = authenticator

    async def CreateKey(self, request, context) -> key_pb2.CreateKeyResponse:
        self._authenticator.authenticate_admin(context.invocation_metadata())
        limits = KeyLimits(**{f: getattr(request.limits, f) if request.limits.HasField(f) else None
                              for f in KEY_LIMIT_NAMES})
        key, secret = self._store.create(
            request.name, all_models=request.all_models, models=request.models, limits=limits,
            env=request.env, admin=request.admin,
        )
        return key_pb2.CreateKeyResponse(key=key_to_pb(key), secret=secret)

    async def ListKeys(self, request, context) -> key_pb2.ListKeysResponse:
        self._authenticator.authenticate_admin(context.invocation_metadata())
        return key_pb2.ListKeysResponse(keys=[key_to_pb(key) for key in self._store.list()])

    async def GetKey(self, request, context) -> key_pb2.GetKeyResponse:
        self._authenticator.authenticate_admin(context.invocation_metadata())
        return key_pb2.GetKeyResponse(key=key_to_pb(self._store.get(request.id)))

    async def RevokeKey(self, request, context) -> key_pb2.RevokeKeyResponse:
        self._authenticator.authenticate_admin(context.invocation_metadata())
        return key_pb2.RevokeKeyResponse(key=key_to_pb(self._store.revoke(request.id)))


def key_to_pb(key: ApiKey) -> key_pb2.ApiKey:
    limits = key_pb2.KeyLimits(**{f: getattr(key.limits, f) for f in KEY_LIMIT_NAMES})
    return key_pb2.ApiKey(
        id=key.id, name=key.name, all_models=key.all_models, models=sorted(key.models), limits=limits,
        env=key.env, admin=key.admin, created=key.created, revoked_at=key.revoked_at,
    )
