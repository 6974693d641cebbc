"""Prompt-cache writes with a one-hour TTL cost `price.cache_write_1h` (configuration.md, price), through Envoy with
the official anthropic SDK and an Anthropic upstream that splits its writes by TTL (`usage.cache_creation`): the
usage-ledger row, the costs API and the key's day budget count what Anthropic bills, JSON answers and streams."""

from __future__ import annotations

import time

import anthropic
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_caller_gone_unary import admin, rows
from tests.e2e.test_fallback_prices import costs, spent_today
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY_ENV

# Anthropic's prices for Sonnet: writes for five minutes at 1.25x input, for an hour at 2x, reads at 0.1x.
PRICE = "{input: 3, output: 15, cached_input: 0.3, cache_write: 3.75, cache_write_1h: 6}"
USAGE = {"input_tokens": 10, "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 1000,
         "cache_creation": {"ephemeral_5m_input_tokens": 300, "ephemeral_1h_input_tokens": 700}, "output_tokens": 5}
# What Anthropic bills for it, in micro-dollars: 10 plain, 2,000 read, 300 written for 5 minutes, 700 for an hour,
# 5 output tokens. One `cache_write` price charged 4,455 (every write at 3.75).
BILLED = 10 * 3 + 2000 * 0.3 + 300 * 3.75 + 700 * 6 + 5 * 15
MESSAGE = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
           "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "usage": USAGE}
EVENTS = [{"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                                "usage": {**USAGE, "output_tokens": 1}}},
          {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
          {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
          {"type": "content_block_stop", "index": 0},
          {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
           "usage": {"output_tokens": 5}},
          {"type": "message_stop"}]
SYSTEM = [{"type": "text", "text": "A long, stable system prompt.",
           "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    anthropic_kind = f"kind: anthropic, base_url: '{double.url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    models = f"""\
  - {{id: claude, endpoint: /v1/messages, provider: {{{anthropic_kind}, model: claude-up, retry: {{attempts: 1}}}},
      price: {PRICE}}}
"""
    with upstream_gateway(tmp_path_factory.mktemp("cache-write-prices"), models) as gateway:
        yield gateway


@pytest.mark.parametrize("stream", [False, True])
def test_one_hour_cache_writes_cost_what_anthropic_bills(gateway, double, stream):
    """The row, the costs API and the day budget said 4,455 micro-dollars where Anthropic billed 6,030: the hour's
    writes were charged at the five-minute price, so a budget let a key spend past it."""
    double.reset()
    double.cue(Cue(frames=[sse(e, e["type"]) for e in EVENTS]) if stream else Cue(body=MESSAGE))
    created = gateway.cli("keys", "create", "--name", f"cache-1h-{stream}", "--all-models",
                          "--max-spend-day", "1").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    headers, since = admin(gateway), int(time.time())
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    if stream:
        with client.messages.stream(model="claude", system=SYSTEM, messages=HI, max_tokens=20) as answer:
            message = answer.get_final_message()
    else:
        message = client.messages.create(model="claude", system=SYSTEM, messages=HI, max_tokens=20)
    assert message.usage.cache_creation_input_tokens == 1000
    assert double.seen[-1].body["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    (row,) = rows(gateway, key_id, headers)
    assert (row["input_tokens"], row["input_cached_tokens"], row["output_tokens"]) == (3010, 2000, 5), row
    assert row["cost_microdollars"] == BILLED == 6030, row
    assert spent_today(gateway, key_id, headers) == costs(gateway, key_id, headers, since) == BILLED
