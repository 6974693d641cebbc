// The models page: the whole configured catalog (GET /v1/admin/models) — what serves each model, its fallbacks,
// price and per-model limits — with each model's requests, errors and cost over the last 7 days.
import {h, money, number, table} from "./dom.js";
import {limitText, LIMITS} from "./keyform.js";
import {errorRate, weekByModel} from "./usage.js";

const PROVIDERS = {llamacpp: "embedded model (llama.cpp)", "dev-image": "development image provider",
  openai: "OpenAI-compatible upstream", anthropic: "Anthropic upstream"};

export async function modelsPage(ctx) {
  const [{models}, week] = await Promise.all([ctx.api.get("/v1/admin/models"), weekByModel(ctx.api)]);
  const rows = models.map((model) => {
    const used = week.get(model.id);
    // The usage API counts chat and messages requests; an image model has only its cost there (console.md).
    const counted = !model.endpoint.startsWith("/v1/images/");
    return [
      [h("code", {class: "id"}, model.id), h("div", {class: "hint"}, model.endpoint)],
      servedBy(model),
      model.fallbacks.length ? model.fallbacks.join(" → ") : "—",
      priceText(model.price),
      limitsText(model.limits),
      !counted ? "—" : used ? number(used.requests) : "0",
      counted && used ? errorRate(used.errors, used.requests) : "—",
      used ? money(used.cost) : money(0),
    ];
  });
  return h("section", {},
    h("h1", {tabindex: "-1"}, "Models"),
    h("p", {class: "hint"}, `${models.length} models in the catalog. Requests, errors and cost are the last 7 days.`),
    table("The model catalog", ["Model and endpoint", "Served by (deployments and their health)", "Fallbacks",
      "Price (USD)", "Limits per key", "Requests", "Errors", "Cost"], rows, {empty: "The catalog is empty."}));
}

function priceText(price) {
  if (!price || !(price.input || price.output || price.cached_input || price.image || price.web_search)) return "free";
  const parts = [];
  if (price.input || price.output) parts.push(`${money(price.input)} in / ${money(price.output)} out per 1M tokens`);
  // Told when it differs from input, free included (0): left out, "$1.00 in" read as the price of cache reads too.
  if (price.cached_input !== undefined && price.cached_input !== price.input) {
    parts.push(`${money(price.cached_input)} cached in per 1M`);
  }
  if (price.cache_write && price.cache_write !== price.input) {
    parts.push(`${money(price.cache_write)} cache writes per 1M`);
  }
  // Told when it differs from five-minute writes (unset in the configuration, it is the same).
  if (price.cache_write_1h && price.cache_write_1h !== (price.cache_write || price.input)) {
    parts.push(`${money(price.cache_write_1h)} hour-long cache writes per 1M`);
  }
  if (price.image) parts.push(`${money(price.image)} per image`);
  if (price.web_search) parts.push(`${money(price.web_search)} per web search`);
  return parts.join("; ");
}

function limitsText(limits) {
  const set = LIMITS.filter(([name]) => limits?.[name])
    .map(([name, label, unit]) => `${label}: ${limitText(unit, limits[name])}`);
  return set.length ? set.join("; ") : "—";
}

// Health in words and symbols, never colour alone: ● healthy, ✕ ejected (cooling down), ◐ on trial (one request
// decides).
const STATES = {healthy: "● healthy", ejected: "✕ ejected", trial: "◐ on trial"};

function servedBy(model) {
  const deployments = model.deployments ?? [];
  const what = (d) => [PROVIDERS[d.provider] ?? d.provider,
    d.upstream_model ? [" as ", h("code", {}, d.upstream_model)] : null];
  if (deployments.length <= 1) return what(deployments[0] ?? model);
  const total = deployments.reduce((sum, d) => sum + d.weight, 0) || 1;
  return h("ul", {class: "deployments"}, deployments.map((d) => h("li", {},
    h("strong", {}, d.name), ` (${Math.round(100 * d.weight / total)} %): `, what(d), " — ",
    h("span", {class: `state ${d.state}`}, STATES[d.state] ?? d.state))));
}
