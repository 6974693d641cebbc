"""A call the pipeline serves (server/pipeline.py): the key, the model and its provider, the RPC's context and its
telemetry record, and what is written on that record and sent as its headers as the call goes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from server.domain import Dialect, Endpoint
from server.domain_keys import ApiKey
from server.domain_models import ModelEntry, Price
from server.keys.auth import Metadata
from server.limits import Reservation, rate_limit_headers
from server.metering import Meter
from server.observability import RequestRecord
from server.providers import Provider
from server.providers.images import ImageProvider
from server.translate.finish_reasons import sent_reason


class CallContext(Protocol):
    """The part of grpc.aio.ServicerContext the pipeline uses."""

    def invocation_metadata(self) -> Metadata | None: ...

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None: ...


@dataclass(frozen=True, slots=True)
class Call:
    """An authenticated request for a model the key may use on this endpoint."""

    key: ApiKey
    model: ModelEntry
    provider: Provider | ImageProvider
    context: CallContext
    record: RequestRecord


def asking(call: Call) -> None:
    """The model is asked now. A model with one deployment is served by it, however it runs: a Router names the
    deployment of each attempt (a fallback's included), but a provider run bare (the embedded model, dev-image) has
    none to name, and its ledger rows said no deployment had served them."""
    if len(call.model.deployments) == 1:
        call.record.deployment = call.model.deployments[0].name
    call.record.upstream_call()


def account(call: Call, price: Price, input_tokens: int = 0, output_tokens: int = 0, cached_input_tokens: int = 0,
            images: int = 0, *, cache_write_tokens: int = 0, cache_write_1h_tokens: int = 0,
            web_searches: int = 0) -> None:
    """What the request used and cost at `price` (the model's that answered), on its record (metrics, access log,
    usage ledger), which settling the reservation hands to the limit store: above the reservation too, when a
    dearer fallback answered."""
    record = call.record
    record.input_tokens, record.output_tokens = input_tokens, output_tokens
    record.cached_input_tokens, record.images = cached_input_tokens, images
    record.cache_write_tokens = cache_write_tokens
    record.cost_micros = price.cost(input_tokens, output_tokens, cached_input_tokens, images, cache_write_tokens,
                                    cache_write_1h_tokens, web_searches)


def note_finish(call: Call, meter: Meter) -> None:
    """How the answer ended, as its caller was told (the request span's gen_ai.response.finish_reasons)."""
    if meter.finished is not None:
        caller = Dialect.ANTHROPIC if call.model.endpoint is Endpoint.MESSAGES else Dialect.OPENAI
        call.record.finish_reason = sent_reason(meter.finished, caller, meter.upstream)


async def send_headers(call: Call, reservation: Reservation, extra: tuple[str, str] | None = None) -> None:
    headers = rate_limit_headers(reservation, anthropic=call.model.endpoint is Endpoint.MESSAGES)
    if extra is not None:
        headers = [*headers, extra]
    if headers:
        await call.context.send_initial_metadata(headers)
