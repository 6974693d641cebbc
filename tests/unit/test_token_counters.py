"""Which exact prompt counter a model's reservation uses."""

from __future__ import annotations

from server.providers import Capabilities, token_counter_of
from server.providers.health import MemoryBoard
from server.providers.retry import ONE_TRY
from server.providers.router import DeploymentRoute, Route, Router


class Counting:
    capabilities = Capabilities()

    def count_tokens(self, turns) -> int:
        return 7

    async def stream(self, request):
        yield None

    async def close(self) -> None:
        pass


class Plain:
    capabilities = Capabilities()

    async def stream(self, request):
        yield None

    async def close(self) -> None:
        pass


def test_a_model_with_fallbacks_keeps_its_token_counter():
    counting, plain = Counting(), Plain()
    assert token_counter_of(counting) is counting and token_counter_of(plain) is None
    assert token_counter_of(_chain(("a", counting), ("b", plain))) is counting
    assert token_counter_of(_chain(("b", plain), ("a", counting))) is None


def _chain(*models) -> Router:
    routes = [Route(model_id, (DeploymentRoute("d", 1.0, provider, ONE_TRY),)) for model_id, provider in models]
    return Router(routes, board=MemoryBoard([]))


def test_a_router_keeps_its_deployments_dialects_so_passthrough_fields_are_not_refused():
    from server.domain import Dialect

    class Upstream(Plain):
        capabilities = Capabilities(tool_calls=True, json_output=True, dialects=frozenset({Dialect.OPENAI}))

    router = _chain(("a", Upstream()))
    assert router.capabilities.dialects == {Dialect.OPENAI} and router.capabilities.tool_calls
