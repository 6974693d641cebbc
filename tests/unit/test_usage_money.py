"""Prices and costs in exact integer micro-dollars."""

from __future__ import annotations

import re

import pytest

from server.config import ConfigError, load_config
from server.usage.money import Price, parse_price, usd_text, usd_to_micros


def test_dollars_become_exact_micro_dollars():
    assert usd_to_micros(5) == 5_000_000
    assert usd_to_micros(0.15) == 150_000  # not 149_999: parsed from its decimal text, never as binary float
    assert usd_to_micros("0.000001") == 1
    for bad in (-1, "abc", True, "0.0000001", float("nan")):
        with pytest.raises(ValueError):
            usd_to_micros(bad)


def test_a_request_costs_its_tokens_rounded_up_once():
    price = parse_price({"input": 2.5, "output": 10, "cached_input": 1.25, "image": 0.04}, "price")
    assert price == Price(input=2_500_000, output=10_000_000, cached_input=1_250_000, image=40_000,
                          cache_write=2_500_000, cache_write_1h=2_500_000)  # cache writes default to input
    # 1000 input (400 of them cached) + 100 output: 600*2.5 + 400*1.25 + 100*10 = 3000 micro-dollars exactly
    assert price.cost(1000, 100, 400) == 3000
    assert price.cost(1, 0) == 3  # 2.5 micro-dollars, rounded up
    assert price.cost(images=3) == 120_000
    assert Price().cost(10**9, 10**9) == 0


def test_prompt_cache_writes_cost_their_own_price_and_the_reservation_the_dearest():
    # Anthropic's five-minute cache: writes at 1.25x the input price, reads at 0.1x.
    price = parse_price({"input": 3, "output": 15, "cached_input": 0.3, "cache_write": 3.75}, "price")
    # 1000 prompt tokens: 600 read, 300 written, 100 plain; 50 output (written never exceeds what is not read).
    assert price.cost(1000, 50, 600, cache_write_tokens=300) == 100 * 3 + 600 * 0.3 + 300 * 3.75 + 50 * 15
    assert price.cost(1000, 50, 900, cache_write_tokens=300) == price.cost(1000, 50, 900, cache_write_tokens=100)
    assert price.most(1000, 50) == price.cost(1000, 50, cache_write_tokens=1000) == 1000 * 3.75 + 50 * 15
    cheaper_writes = parse_price({"input": 3, "output": 15, "cache_write": 1}, "price")
    assert cheaper_writes.most(1000, 50) == 1000 * 3 + 50 * 15


def test_one_hour_cache_writes_cost_their_own_price_and_default_to_cache_write():
    """Anthropic bills a prompt-cache write with a one-hour TTL at 2x input, a five-minute one at 1.25x: with one
    `cache_write` price a key writing for an hour was charged less than Anthropic billed, and its budget not kept."""
    price = parse_price({"input": 3, "output": 15, "cached_input": 0.3, "cache_write": 3.75, "cache_write_1h": 6},
                        "price")
    assert price.cache_write_1h == 6_000_000
    # 1000 prompt tokens: 600 read, 300 written (200 of them for an hour), 100 plain; 50 output.
    assert price.cost(1000, 50, 600, cache_write_tokens=300, cache_write_1h_tokens=200) == \
        100 * 3 + 600 * 0.3 + 100 * 3.75 + 200 * 6 + 50 * 15
    # The hour's part is part of the writes, never more than them.
    assert price.cost(1000, 50, 600, cache_write_tokens=300, cache_write_1h_tokens=900) == \
        price.cost(1000, 50, 600, cache_write_tokens=300, cache_write_1h_tokens=300) == \
        100 * 3 + 600 * 0.3 + 300 * 6 + 50 * 15
    # A budget reserves every prompt token at the dearest prompt price: here the hour's writes.
    assert price.most(1000, 50) == 1000 * 6 + 50 * 15
    # Unset, it is cache_write's (itself input's when unset): existing prices keep their costs.
    assert parse_price({"input": 3, "cache_write": 3.75}, "p").cache_write_1h == 3_750_000
    assert parse_price({"input": 3}, "p").cache_write_1h == 3_000_000
    plain = parse_price({"input": 3, "output": 15, "cache_write": 3.75}, "p")
    assert plain.cost(1000, 50, cache_write_tokens=300, cache_write_1h_tokens=200) == \
        plain.cost(1000, 50, cache_write_tokens=300)


@pytest.mark.parametrize("value", [-1, "abc", "0.0000001", 1_000_001])
def test_a_bad_one_hour_cache_write_price_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=r"price\.cache_write_1h"):
        parse_price({"input": 3, "cache_write_1h": value}, "price")


def test_an_unknown_price_setting_lists_the_one_hour_cache_write_price():
    with pytest.raises(ConfigError, match="cache_write_1h"):
        parse_price({"cache_write_2h": 6}, "price")


def test_web_searches_cost_their_price_each_and_are_not_reserved():
    """Anthropic bills its web search server tool per search ($10 per 1,000), on top of the tokens."""
    price = parse_price({"input": 3, "output": 15, "web_search": 0.01}, "price")
    assert price.web_search == 10_000  # micro-dollars a search
    assert price.cost(1000, 50, web_searches=3) == 1000 * 3 + 50 * 15 + 3 * 10_000
    assert price.most(1000, 50) == 1000 * 3 + 50 * 15  # a request's searches are unknown before it runs
    assert parse_price({"input": 3}, "p").web_search == 0
    with pytest.raises(ConfigError, match=r"price\.web_search"):
        parse_price({"web_search": -1}, "price")


def test_cached_input_defaults_to_the_input_price():
    assert parse_price({"input": 3, "output": 15}, "p").cached_input == 3_000_000


def test_price_mistakes_name_the_field():
    with pytest.raises(ConfigError, match="price.output"):
        parse_price({"output": -2}, "price")
    with pytest.raises(ConfigError, match="unknown setting"):
        parse_price({"inputs": 2}, "price")



@pytest.mark.parametrize("price", [{"input": 1e30}, {"output": 1_000_001}, {"image": "1e12"}])
def test_a_price_over_a_million_dollars_is_refused(price):
    """`input: 1e30` was taken: one request's cost then overflowed the ledger's BIGINT, and the batch holding that
    row failed on every retry, so no request's row was written any more."""
    with pytest.raises(ConfigError, match="at most 1000000"):
        parse_price(price, "price")
    assert parse_price({"input": 1_000_000, "image": 1_000_000}, "price").input == 10**12

def test_usd_text():
    assert usd_text(10_000) == "$0.01"
    assert usd_text(5_000_000) == "$5.00"
    assert usd_text(12_345) == "$0.012345"


def test_prices_in_the_configuration(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("models:\n  - {id: m, endpoint: /v1/chat/completions, provider: {kind: llamacpp},"
                      " price: {input: 1, output: 2}}\nusage: {retention_days: 30}\n")
    loaded = load_config(config)
    assert loaded.models[0].price == Price(1_000_000, 2_000_000, 1_000_000, 0, 1_000_000, 1_000_000, 0)
    assert loaded.usage.retention_days == 30
    config.write_text("models:\n  - {id: m, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}\n"
                      "usage: {flush_every: 1}\n")
    with pytest.raises(ConfigError, match="usage"):
        load_config(config)


@pytest.mark.parametrize("setting, value", [("retention_days", 0.5), ("retention_days", "30"),
                                            ("batch_rows", 2.5), ("buffer_rows", True), ("flush_seconds", "1")])
def test_usage_settings_that_are_not_whole_numbers_are_refused_naming_them(tmp_path, setting, value):
    """`retention_days: 0.5` became 0 (keep forever) and `batch_rows: 2.5` became 2, silently."""
    config = tmp_path / "c.yaml"
    config.write_text("models:\n  - {id: m, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}\n"
                      f"usage: {{{setting}: {value!r}}}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=f"usage.{setting}: a "):
        load_config(config)


@pytest.mark.parametrize(("endpoint", "price", "named"), [
    ("/v1/images/generations", "{input: 5, output: 40}", "price.input"),  # gpt-image-1's published token prices
    ("/v1/images/generations", "{image: 0.04, cache_write: 1}", "price.cache_write"),
    ("/v1/chat/completions", "{input: 1, image: 0.04}", "price.image"),
    ("/v1/messages", "{image: 0.04}", "price.image"),
])
def test_a_price_no_request_of_the_model_could_be_charged_is_refused(tmp_path, endpoint, price, named):
    """Image requests use no tokens and text requests make no images: such a price would cost nothing, silently, and
    a budget would never stop the model's requests."""
    provider = "dev-image" if "images" in endpoint else "llamacpp"
    config = tmp_path / "c.yaml"
    config.write_text(f"models:\n  - {{id: m, endpoint: {endpoint}, provider: {{kind: {provider}}}, price: {price}}}\n")
    with pytest.raises(ConfigError, match=rf"models\[0\]\.{re.escape(named)}: "):
        load_config(config)
