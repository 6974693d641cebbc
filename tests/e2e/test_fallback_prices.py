"""A request one of its model's `fallbacks` served is priced at the model that answered (configuration.md, Fallbacks),
through the whole stack with the official SDK, in both limit stores: its usage-ledger row, the costs API, the spend
metric and the key's budget all count the fallback's price, and a budget the fallback spent refuses the next request.
Admission still reserves the asked model's most cost; settlement counts the whole of what was spent, above it too."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.e2e.conftest import Gateway, upstream_gateway
from tests.e2e.test_caller_gone_unary import admin, rows  # the ledger's rows of a key, as the requests API has them
from tests.e2e.test_context_fallbacks import HELLO, OPENAI_TOO_LONG, UNAVAILABLE, asked
from tests.e2e.test_operations import scrape, value
from tests.upstream_double import Cue
from tests.upstream_echo import echo_chat
from tests.upstream_support import UPSTREAM_KEY_ENV

CHEAP, DEAR = 1, 100_000  # dollars per million tokens: a token costs 1 micro-dollar, or a tenth of a dollar
IMAGES = "/v1/images/generations"
IMAGE_CHEAP, IMAGE_DEAR = 0.01, 0.5  # dollars an image


def models_yaml(url: str) -> str:
    openai_kind = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    one_try = "retry: {attempts: 1}"
    return f"""\
  - {{id: cheap, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: cheap-up, {one_try}}},
      fallbacks: [dear], price: {{input: {CHEAP}, output: {CHEAP}}}}}
  - {{id: dear, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: dear-up, {one_try}}},
      price: {{input: {DEAR}, output: {DEAR}}}}}
  - {{id: paid, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: paid-up, {one_try}}},
      fallbacks: [gratis], price: {{input: {DEAR}, output: {DEAR}}}}}
  - {{id: gratis, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: gratis-up, {one_try}}}}}
  - {{id: free, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: free-up, {one_try}}},
      fallbacks: [dear]}}
  - {{id: image-cheap, endpoint: {IMAGES}, provider: {{{openai_kind}, model: image-cheap-up, {one_try}}},
      fallbacks: [image-dear], price: {{image: {IMAGE_CHEAP}}}}}
  - {{id: image-dear, endpoint: {IMAGES}, provider: {{{openai_kind}, model: image-dear-up, {one_try}}},
      price: {{image: {IMAGE_DEAR}}}}}
"""


@pytest.fixture(scope="module", params=["memory", "redis"])
def gateway(request, double, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"fallback-prices-{request.param}")
    models = models_yaml(double.url)
    if request.param == "redis":  # a top-level setting after the model list
        models += f"limits: {{store: '{request.getfixturevalue('redis_server').url}'}}\n"
    with upstream_gateway(directory, models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def key(gateway: Gateway, name: str, *limits: str) -> tuple[str, openai.OpenAI]:
    out = gateway.cli("keys", "create", "--name", name, "--all-models", *limits).stdout
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=out.split()[-1], max_retries=0)
    return out.split()[2], client


def spent_today(gateway: Gateway, key_id: str, headers: dict[str, str]) -> int:
    """The key's day spend as its limit store settled it, in micro-dollars."""
    limits = httpx.get(f"{gateway.base_url}/v1/admin/keys/{key_id}/limits", headers=headers, timeout=30).json()
    (used,) = [limit["used"] for limit in limits["limits"] if limit["limit"] == "max_spend_day" and not limit["model"]]
    return round(used * 1_000_000)


def costs(gateway: Gateway, key_id: str, headers: dict[str, str], since: int) -> int:
    """The key's cost since `since` (seconds) by the costs API, in micro-dollars."""
    answer = httpx.get(f"{gateway.base_url}/v1/organization/costs", headers=headers, timeout=30,
                       params={"start_time": since, "bucket_width": "1m", "api_key_ids": key_id}).json()
    return sum(result["amount_microdollars"] for bucket in answer["data"] for result in bucket["results"])


def counted_alike(gateway: Gateway, key_id: str, headers: dict[str, str], row: dict, before: dict) -> None:
    """The ledger's cost is what the limit store settled, the costs API and the spend metric say."""
    spend = value(scrape(gateway), "portico_spend_microdollars_total", model=row["model"], key_id=key_id) - value(
        before, "portico_spend_microdollars_total", model=row["model"], key_id=key_id)
    assert (spent_today(gateway, key_id, headers), costs(gateway, key_id, headers, row["created"]), spend) == (
        row["cost_microdollars"],) * 3


def test_a_request_a_dearer_fallback_served_costs_the_fallbacks_price(gateway, double):
    """It cost the asked model's price (5 micro-dollars for 5 tokens): the ledger, budgets, costs API and spend
    metric under-counted what the operator paid the fallback's upstream. Now it costs the fallback's."""
    key_id, client = key(gateway, "served-dear", "--max-spend-day", "100")
    headers, before = admin(gateway), scrape(gateway)
    double.cue(UNAVAILABLE)
    answer = client.chat.completions.create(model="cheap", messages=HELLO, max_tokens=8)
    assert answer.choices[0].message.content == "echo Say hello." and asked(double) == ["cheap-up", "dear-up"]
    (row,) = rows(gateway, key_id, headers)
    assert (row["model"], row["upstream"], row["input_tokens"], row["output_tokens"]) == ("cheap", "dear", 2, 3)
    assert row["cost_microdollars"] == 5 * DEAR
    counted_alike(gateway, key_id, headers, row, before)


def test_a_stream_a_fallback_served_for_a_prompt_too_long_costs_its_price(gateway, double):
    key_id, client = key(gateway, "streamed-dear", "--max-spend-day", "100")
    headers, before = admin(gateway), scrape(gateway)
    double.cue(OPENAI_TOO_LONG)
    chunks = client.chat.completions.create(model="cheap", messages=HELLO, max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == "echo Say hello."
    (row,) = rows(gateway, key_id, headers)
    assert (row["upstream"], row["status"], row["input_tokens"] + row["output_tokens"]) == ("dear", 200, 5)
    assert row["cost_microdollars"] == 5 * DEAR
    counted_alike(gateway, key_id, headers, row, before)


def test_a_stream_a_fallback_broke_off_costs_what_it_sent_at_its_price(gateway, double):
    key_id, client = key(gateway, "cut-dear", "--max-spend-day", "100")
    headers, before = admin(gateway), scrape(gateway)
    double.cue(UNAVAILABLE, Cue(drop_after=3))  # the fallback's stream breaks after its role and two words
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="cheap", messages=HELLO, max_tokens=8, stream=True))
    (row,) = rows(gateway, key_id, headers)
    assert (row["upstream"], row["status"], row["code"]) == ("dear", 200, "upstream_error"), row  # in-band
    assert row["output_tokens"] > 0, row
    assert row["cost_microdollars"] == (row["input_tokens"] + row["output_tokens"]) * DEAR
    counted_alike(gateway, key_id, headers, row, before)


def test_a_day_budget_the_fallback_spent_refuses_the_next_request(gateway, double):
    """A $0.40 budget: the asked model's most cost (under 30 micro-dollars) fits, the fallback's answer costs $0.50,
    and the budget, counted whole, refuses the next request until UTC midnight (it let every one in before)."""
    key_id, client = key(gateway, "budget-dear", "--max-spend-day", "0.4")
    headers = admin(gateway)
    double.cue(UNAVAILABLE)
    client.chat.completions.create(model="cheap", messages=HELLO, max_tokens=8)
    (row,) = rows(gateway, key_id, headers)
    assert row["cost_microdollars"] == spent_today(gateway, key_id, headers) == 5 * DEAR
    # Nothing left (as the limits API's `remaining` says), not a negative amount.
    assert value(scrape(gateway), "portico_budget_remaining_microdollars", key_id=key_id, budget="day") == 0
    double.reset()
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="cheap", messages=HELLO, max_tokens=8)
    assert caught.value.body["message"].startswith("Budget reached") and "spent $0.50," in caught.value.body["message"]
    assert double.seen == []


@pytest.mark.parametrize("budget", ["0.4", "0.5"])  # spent past its limit; spent exactly to it (nothing left)
def test_a_budget_a_priced_fallback_spent_refuses_its_model_without_a_price(gateway, double, budget):
    """A model without a price reserves nothing, and was never refused by a budget: its fallback's answers, counted at
    the fallback's price, spent past the budget without end; spent exactly to its limit ($0.50 of $0.50: the limits
    API says nothing left), it still let the model in, where a model with a price was refused. Now both are."""
    key_id, client = key(gateway, f"budget-free-{budget}", "--max-spend-day", budget)
    headers = admin(gateway)
    client.chat.completions.create(model="free", messages=HELLO, max_tokens=8)  # served by itself: free
    double.cue(UNAVAILABLE)
    client.chat.completions.create(model="free", messages=HELLO, max_tokens=8)
    assert sorted(row["cost_microdollars"] for row in rows(gateway, key_id, headers, want=2)) == [0, 5 * DEAR]
    double.reset()
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="free", messages=HELLO, max_tokens=8)
    assert caught.value.body["message"].startswith(
        f"Budget reached for the spend per UTC day budget of key {key_id}: limit ${budget}0, spent $0.50, a fallback "
        "with a price may answer this request. The budget resets at "), caught.value.body["message"]
    assert double.seen == [] and spent_today(gateway, key_id, headers) == 5 * DEAR


def test_a_fallback_without_a_price_costs_nothing(gateway, double):
    """As a request to it directly would: it cost the asked model's price."""
    key_id, client = key(gateway, "served-free", "--max-spend-day", "100")
    headers, before = admin(gateway), scrape(gateway)
    double.cue(UNAVAILABLE)
    client.chat.completions.create(model="paid", messages=HELLO, max_tokens=8)
    (row,) = rows(gateway, key_id, headers)
    assert (row["upstream"], row["input_tokens"] + row["output_tokens"], row["cost_microdollars"]) == ("gratis", 5, 0)
    counted_alike(gateway, key_id, headers, row, before)


def test_images_a_dearer_fallback_drew_cost_its_price(gateway, double):
    headers, before = admin(gateway), scrape(gateway)
    out = gateway.cli("keys", "create", "--name", "images", "--all-models", "--max-spend-day", "100").stdout
    key_id, secret = out.split()[2], out.split()[-1]
    double.cue(UNAVAILABLE)
    answer = httpx.post(f"{gateway.base_url}{IMAGES}", headers={"authorization": f"Bearer {secret}"}, timeout=30,
                        json={"model": "image-cheap", "prompt": "a lighthouse", "n": 2, "response_format": "b64_json"})
    assert answer.status_code == 200 and len(answer.json()["data"]) == 2, answer.text
    (row,) = rows(gateway, key_id, headers)
    assert (row["upstream"], row["images"]) == ("image-dear", 2)
    assert row["cost_microdollars"] == round(2 * IMAGE_DEAR * 1_000_000)
    counted_alike(gateway, key_id, headers, row, before)


def test_the_budget_gauge_counts_what_requests_that_ran_meanwhile_spent(gateway, double):
    """portico_budget_remaining_microdollars: a stream admitted first and ended last set it to what its admission
    read less its own cost, as if the request that was answered while it ran had spent nothing."""
    key_id, client = key(gateway, "gauge", "--max-spend-day", "100")
    headers = admin(gateway)
    double.cue(Cue(frame_delay=0.3))  # the stream takes a second or two
    stream = client.chat.completions.create(model="dear", messages=HELLO, max_tokens=8, stream=True)
    client.chat.completions.create(model="dear", messages=HELLO, max_tokens=8)  # answered while the stream runs
    list(stream)
    found = rows(gateway, key_id, headers, want=2)  # both have ended, and paid
    assert len(found) == 2 and all(row["cost_microdollars"] > 0 for row in found), found
    left = 100_000_000 - spent_today(gateway, key_id, headers)
    assert left == 100_000_000 - sum(row["cost_microdollars"] for row in found)
    assert value(scrape(gateway), "portico_budget_remaining_microdollars", key_id=key_id, budget="day") == left


def test_requests_running_at_once_that_a_dearer_fallback_served_each_go_past_the_budget(gateway, double):
    """Each reserved the asked model's most cost (a model without a price: one micro-dollar), admitted before any of
    them was settled; each fallback answer then counts whole. So a budget is taken past its limit by every such
    request that ran at the same time, not by one (configuration.md, Fallbacks), and refuses the next."""
    key_id, client = key(gateway, "budget-dear-at-once", "--max-spend-day", "0.4")
    headers = admin(gateway)

    def primary_down(body: dict) -> dict:  # the model asked for fails; its fallback answers, slowly enough to overlap
        if body["model"] == "free-up":
            return {"error": {"message": "overloaded", "type": "server_error", "code": "503"}}
        return echo_chat(body)

    double.defaults["/v1/chat/completions"] = primary_down
    double.default_cue = Cue(delay=0.5)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: client.chat.completions.create(
                model="free", messages=HELLO, max_tokens=8), range(4)))
    finally:
        double.defaults["/v1/chat/completions"] = echo_chat
        double.default_cue = Cue()
    assert all(a.choices[0].message.content == "echo Say hello." for a in answers)
    assert spent_today(gateway, key_id, headers) == 4 * 5 * DEAR  # $2.00 of a $0.40 budget
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="free", messages=HELLO, max_tokens=8)
