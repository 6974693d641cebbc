"""Which exact prompt counter a model's reservation uses."""

from __future__ import annotations

from server.providers import Capabilities, token_counter_of
from server.providers.fallback import FallbackProvider


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
    assert token_counter_of(FallbackProvider([("a", counting), ("b", plain)])) is counting
    assert token_counter_of(FallbackProvider([("b", plain), ("a", counting)])) is None
