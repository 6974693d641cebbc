// The usage page: requests, tokens and cost per hour or day, by model or by key, for a chosen period, read from
// the OpenAI-shaped usage API (/v1/organization/usage/completions and /v1/organization/costs).
import {timeChart} from "./chart.js";
import {field, h, money, number, table} from "./dom.js";

const HOUR = 3600;
const DAY = 86400;
// A preset's length in seconds, or a function giving its start from now.
const PERIODS = {
  "24h": ["Last 24 hours", DAY],
  week: ["This week (since Monday, UTC)", (now) => startOfDay(now) - ((utc(now).getUTCDay() + 6) % 7) * DAY],
  "7d": ["Last 7 days", 7 * DAY],
  month: ["This month (UTC)", (now) => Date.UTC(utc(now).getUTCFullYear(), utc(now).getUTCMonth(), 1) / 1000],
  "30d": ["Last 30 days", 30 * DAY],
};
const utc = (seconds) => new Date(seconds * 1000);
const startOfDay = (seconds) => Math.floor(seconds / DAY) * DAY;
const GROUPS = {model: "Model", api_key_id: "Key"};
const MAX_SERIES = 7;  // more lines than this are unreadable: the rest are summed as "other"

// Every bucket of a paged usage or costs answer (OpenAI pages through buckets with has_more / next_page).
export async function buckets(api, path, params) {
  const all = [];
  let page = null;
  do {
    const query = new URLSearchParams(params);
    if (page) query.set("page", page);
    const answer = await api.get(`${path}?${query}`);
    all.push(...answer.data);
    page = answer.has_more ? answer.next_page : null;
  } while (page);
  return all;
}

export function usageParams({start, end, width, groups = [], keyIds = []}) {
  const params = [["start_time", start], ["end_time", end], ["bucket_width", width === HOUR ? "1h" : "1d"],
    ["limit", width === HOUR ? 168 : 31]];
  groups.forEach((group) => params.push(["group_by", group]));
  keyIds.forEach((id) => params.push(["api_key_ids", id]));
  return params;
}

// The period the page shows: a preset ending now, or whole UTC days from..to (inclusive).
function periodOf(query) {
  const now = Math.floor(Date.now() / 1000);
  const from = query.get("from"), to = query.get("to");
  if (from && to) {
    const start = Date.parse(`${from}T00:00:00Z`) / 1000, end = Date.parse(`${to}T00:00:00Z`) / 1000 + DAY;
    if (start < end) return {start, end: Math.min(end, now + HOUR), label: `${from} to ${to}`, key: "custom"};
  }
  const key = PERIODS[query.get("period")] ? query.get("period") : "week";
  const [label, length] = PERIODS[key];
  return {start: typeof length === "function" ? length(now) : now - length, end: now, label, key};
}

export async function usagePage(ctx) {
  try {
    return await usageView(ctx);
  } catch (error) {
    if (error.status !== 404) throw error;
    return h("section", {}, h("h1", {tabindex: "-1"}, "Usage"),
      h("p", {class: "error", role: "alert"}, "This gateway has no usage API (/v1/organization/usage): ",
        "it is older than the console, or its usage ledger is turned off."));
  }
}

async function usageView(ctx) {
  const period = periodOf(ctx.query);
  const group = GROUPS[ctx.query.get("group")] ? ctx.query.get("group") : "model";
  const bucket = ctx.query.get("bucket") ?? (period.end - period.start <= DAY ? "hour" : "day");
  const width = bucket === "hour" ? HOUR : DAY;
  // Buckets start on whole hours or UTC days, so a chart's points line up with the table's.
  const start = Math.floor(period.start / width) * width;
  const params = usageParams({start, end: period.end, width, groups: [group]});
  const [usage, costs, byKeyAndModel, costsByKeyAndModel, {keys}] = await Promise.all([
    buckets(ctx.api, "/v1/organization/usage/completions", params),
    costBuckets(ctx.api, start, period.end, width, [group]),
    buckets(ctx.api, "/v1/organization/usage/completions",
      usageParams({start, end: period.end, width: DAY, groups: ["api_key_id", "model"]})),
    costBuckets(ctx.api, start, period.end, DAY, ["api_key_id", "model"]),
    ctx.api.get("/v1/admin/keys"),
  ]);
  const names = new Map(keys.map((key) => [key.id, key.name]));
  const labelOf = (result) => group === "model" ? result.model ?? "(none)" : keyLabel(names, result.api_key_id);

  const times = usage.map((bucket) => bucket.start_time);
  const requests = seriesOf(usage, labelOf, (r) => r.num_model_requests);
  // The same group keeps its colour and dash in every chart: ordered as in the requests chart.
  const order = requests.map((s) => s.label);
  const tokens = seriesOf(usage, labelOf, (r) => r.input_tokens + r.output_tokens, order);
  const costTimes = costs.buckets.map((bucket) => bucket.start_time);
  const cost = seriesOf(costs.buckets, labelOf, (r) => r.amount?.value ?? 0, order);
  const summary = summaryOf(usage);

  return h("section", {},
    h("h1", {tabindex: "-1"}, "Usage"),
    filters(ctx, period, group, width),
    h("div", {class: "cards", role: "list", "aria-label": `Totals, ${period.label}`},
      card("Requests", number(summary.requests)),
      card("Input tokens", number(summary.input)),
      card("Output tokens", number(summary.output)),
      card("Cost", money(total(cost))),
      card("Error rate", summary.errors === null ? "—" :
        `${(100 * summary.errors / Math.max(1, summary.admitted)).toFixed(1)} % (${number(summary.errors)})`),
      card("Latency p50", summary.p50 === null ? "—" : `≈ ${number(Math.round(summary.p50))} ms`),
      card("Latency p95", summary.p95 === null ? "—" : `≈ ${number(Math.round(summary.p95))} ms`)),
    timeChart({id: "chart-requests", title: `Requests by ${GROUPS[group].toLowerCase()}`, times, series: requests,
      format: number, integer: true, bucketLabel: width === HOUR ? "hour" : "day"}),
    timeChart({id: "chart-tokens", title: `Tokens (input + output) by ${GROUPS[group].toLowerCase()}`, times,
      series: tokens, format: number, integer: true, bucketLabel: width === HOUR ? "hour" : "day"}),
    timeChart({id: "chart-cost", title: `Cost (USD) by ${GROUPS[group].toLowerCase()}`, times: costTimes,
      series: cost, format: (v) => money(v), bucketLabel: costs.width === HOUR ? "hour" : "day"}),
    spendTable(byKeyAndModel, costsByKeyAndModel.buckets, names, period.label));
}

// OpenAI's costs API has daily buckets only; hourly costs are asked for and, if refused, shown per day.
async function costBuckets(api, start, end, width, groups) {
  const ask = (w) => buckets(api, "/v1/organization/costs", usageParams({start, end, width: w, groups}));
  if (width === HOUR) {
    try {
      return {buckets: await ask(HOUR), width: HOUR};
    } catch (error) {
      if (error.status !== 400) throw error;
    }
  }
  return {buckets: await ask(DAY), width: DAY};
}

function keyLabel(names, id) {
  if (!id) return "(none)";
  return names.has(id) ? `${names.get(id)} (${id})` : id;
}

// One series per group, largest first (or in the given order); past MAX_SERIES the rest are summed into "other".
function seriesOf(bucketList, labelOf, valueOf, order = []) {
  const byLabel = new Map();
  bucketList.forEach((bucket, i) => {
    for (const result of bucket.results) {
      const label = labelOf(result);
      if (!byLabel.has(label)) byLabel.set(label, new Array(bucketList.length).fill(0));
      byLabel.get(label)[i] += valueOf(result);
    }
  });
  const rank = (label) => order.includes(label) ? order.indexOf(label) : order.length;
  const series = [...byLabel].map(([label, values]) => ({label, values}))
    .sort((a, b) => rank(a.label) - rank(b.label) || total([b]) - total([a]));
  if (series.length <= MAX_SERIES) return series;
  const other = new Array(bucketList.length).fill(0);
  series.slice(MAX_SERIES - 1).forEach((s) => s.values.forEach((v, i) => { other[i] += v; }));
  return [...series.slice(0, MAX_SERIES - 1), {label: "other", values: other}];
}

const total = (series) => series.reduce((sum, s) => sum + s.values.reduce((a, b) => a + b, 0), 0);

// Totals over the period. Error rate and latency are Portico's additions to OpenAI's results: num_errors of
// num_requests (every admitted request), and each bucket's latency_ms_p50/p95, whose mean weighted by requests
// stands for the period's (an estimate, as the buckets' own are).
function summaryOf(usage) {
  const summary = {requests: 0, admitted: 0, input: 0, output: 0, errors: null, p50: null, p95: null};
  let timed = 0, p50 = 0, p95 = 0;
  for (const bucket of usage) {
    for (const r of bucket.results) {
      summary.requests += r.num_model_requests;
      summary.admitted += r.num_requests ?? r.num_model_requests;
      summary.input += r.input_tokens;
      summary.output += r.output_tokens;
      if (typeof r.num_errors === "number") summary.errors = (summary.errors ?? 0) + r.num_errors;
      if (typeof r.latency_ms_p50 === "number" && r.num_model_requests) {
        timed += r.num_model_requests;
        p50 += r.latency_ms_p50 * r.num_model_requests;
        p95 += (r.latency_ms_p95 ?? r.latency_ms_p50) * r.num_model_requests;
      }
    }
  }
  if (timed) [summary.p50, summary.p95] = [p50 / timed, p95 / timed];
  return summary;
}

function spendTable(usage, costs, names, periodLabel) {
  const rows = new Map();
  const row = (r) => {
    const id = `${r.api_key_id}|${r.model}`;
    if (!rows.has(id)) rows.set(id, {key: r.api_key_id, model: r.model, requests: 0, input: 0, output: 0, cost: 0});
    return rows.get(id);
  };
  usage.forEach((b) => b.results.forEach((r) => {
    const entry = row(r);
    entry.requests += r.num_model_requests;
    entry.input += r.input_tokens;
    entry.output += r.output_tokens;
  }));
  costs.forEach((b) => b.results.forEach((r) => { row(r).cost += r.amount?.value ?? 0; }));
  const sorted = [...rows.values()].sort((a, b) => b.cost - a.cost || b.requests - a.requests);
  return h("div", {},
    h("h2", {}, "Who spent what, on which model"),
    table(`Spend by key and model, ${periodLabel}`,
      ["Key", "Model", "Requests", "Input tokens", "Output tokens", "Cost"],
      sorted.map((r) => [
        r.key ? h("a", {href: `#/keys/${encodeURIComponent(r.key)}`}, keyLabel(names, r.key)) : "(none)",
        r.model ?? "(none)", number(r.requests), number(r.input), number(r.output), money(r.cost)]),
      {empty: "No requests in this period."}));
}

function card(label, value) {
  return h("div", {class: "card", role: "listitem"},
    h("div", {class: "label"}, label), h("div", {class: "value"}, value));
}

function filters(ctx, period, group, width) {
  const periodSelect = h("select", {name: "period"},
    Object.entries(PERIODS).map(([key, [label]]) => h("option", {value: key, selected: key === period.key}, label)),
    h("option", {value: "custom", selected: period.key === "custom"}, "Chosen days"));
  const today = new Date().toISOString().slice(0, 10);
  const from = h("input", {type: "date", name: "from", value: ctx.query.get("from") ?? today, max: today});
  const to = h("input", {type: "date", name: "to", value: ctx.query.get("to") ?? today, max: today});
  const groupSelect = h("select", {name: "group"},
    Object.entries(GROUPS).map(([key, label]) => h("option", {value: key, selected: key === group}, label)));
  const bucketSelect = h("select", {name: "bucket"},
    h("option", {value: "hour", selected: width === HOUR}, "Hour"),
    h("option", {value: "day", selected: width === DAY}, "Day"));
  const dates = h("div", {class: "dates", hidden: period.key !== "custom"},
    field("From (UTC)", from), field("To (UTC)", to));
  periodSelect.addEventListener("change", () => { dates.hidden = periodSelect.value !== "custom"; });
  const apply = (event) => {
    event.preventDefault();
    const query = new URLSearchParams();
    if (periodSelect.value === "custom") {
      query.set("from", from.value);
      query.set("to", to.value);
    } else {
      query.set("period", periodSelect.value);
    }
    query.set("group", groupSelect.value);
    query.set("bucket", bucketSelect.value);
    ctx.go(`#/usage?${query}`);
  };
  return h("form", {class: "filters", "aria-label": "Usage filters", onsubmit: apply},
    field("Period", periodSelect), dates, field("By", groupSelect), field("Per", bucketSelect),
    h("button", {type: "submit"}, "Show"));
}

// A key's last 7 days by model (its page): requests per day as a chart, and totals with their cost.
export async function keyUsage(api, keyId) {
  const end = Math.floor(Date.now() / 1000);
  const start = Math.floor((end - 6 * DAY) / DAY) * DAY;  // today and the 6 UTC days before it
  const params = usageParams({start, end, width: DAY, groups: ["model"], keyIds: [keyId]});
  let usage, costs;
  try {
    [usage, costs] = await Promise.all([buckets(api, "/v1/organization/usage/completions", params),
      buckets(api, "/v1/organization/costs", params)]);
  } catch (error) {
    if (error.status !== 404) throw error;
    return h("p", {class: "empty"}, "This gateway has no usage API.");
  }
  const labelOf = (r) => r.model ?? "(none)";
  const requests = seriesOf(usage, labelOf, (r) => r.num_model_requests);
  const rows = new Map();
  const row = (model) => rows.get(model)
    ?? rows.set(model, {requests: 0, errors: 0, input: 0, output: 0, cost: 0}).get(model);
  usage.forEach((b) => b.results.forEach((r) => {
    const entry = row(labelOf(r));
    entry.requests += r.num_model_requests;
    entry.errors += r.num_errors ?? 0;
    entry.input += r.input_tokens;
    entry.output += r.output_tokens;
  }));
  costs.forEach((b) => b.results.forEach((r) => { row(labelOf(r)).cost += r.amount?.value ?? 0; }));
  const sorted = [...rows].sort(([, a], [, b]) => b.cost - a.cost || b.requests - a.requests);
  const spent = sorted.reduce((sum, [, r]) => sum + r.cost, 0);
  return h("div", {},
    h("h2", {}, `Last 7 days: ${money(spent)}`),
    timeChart({id: "chart-key-requests", title: "Requests per day by model", times: usage.map((b) => b.start_time),
      series: requests, format: number, integer: true, bucketLabel: "day"}),
    table("The key's use of each model, last 7 days", ["Model", "Requests", "Errors", "Input tokens", "Output tokens",
      "Cost"], sorted.map(([model, r]) => [model, number(r.requests), number(r.errors), number(r.input),
      number(r.output), money(r.cost)]), {empty: "No requests in the last 7 days."}));
}

// Each model's requests, errors and cost over the last 7 days (the models page); empty without a usage API.
export async function weekByModel(api) {
  const end = Math.floor(Date.now() / 1000);
  const start = Math.floor((end - 6 * DAY) / DAY) * DAY;
  const params = usageParams({start, end, width: DAY, groups: ["model"]});
  const byModel = new Map();
  const entry = (model) => byModel.get(model) ?? byModel.set(model, {requests: 0, admitted: 0, errors: 0, cost: 0})
    .get(model);
  try {
    const [usage, costs] = await Promise.all([buckets(api, "/v1/organization/usage/completions", params),
      buckets(api, "/v1/organization/costs", params)]);
    usage.forEach((b) => b.results.forEach((r) => {
      const e = entry(r.model);
      e.requests += r.num_model_requests;
      e.admitted += r.num_requests ?? r.num_model_requests;
      e.errors += r.num_errors ?? 0;
    }));
    costs.forEach((b) => b.results.forEach((r) => { entry(r.model).cost += r.amount?.value ?? 0; }));
  } catch (error) {
    if (error.status !== 404) throw error;
  }
  return byModel;
}
