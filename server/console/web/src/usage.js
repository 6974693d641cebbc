// The usage page: requests, tokens and cost per hour or day, by model or by key, for a chosen period, read from
// the OpenAI-shaped usage API (/v1/organization/usage/completions and /v1/organization/costs).
import {timeChart} from "./chart.js";
import {field, h, money, number, table, when} from "./dom.js";

const HOUR = 3600;
const DAY = 86400;
// A preset's label, and its start from now. Every start is a whole hour or UTC day, where the API's buckets start
// (it aligns a query's start_time down to its bucket width), so the buckets cover exactly the period shown.
const PERIODS = {
  "24h": ["Last 24 hours", (now) => Math.floor((now - DAY) / HOUR) * HOUR],
  week: ["This week (since Monday, UTC)", (now) => startOfDay(now) - ((utc(now).getUTCDay() + 6) % 7) * DAY],
  "7d": ["Last 7 days (today and the 6 UTC days before)", (now) => startOfDay(now) - 6 * DAY],
  month: ["This month (UTC)", (now) => Date.UTC(utc(now).getUTCFullYear(), utc(now).getUTCMonth(), 1) / 1000],
  "30d": ["Last 30 days (today and the 29 UTC days before)", (now) => startOfDay(now) - 29 * DAY],
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
  let refused = null;  // days in the link that make no period (To before From, a day to come, not a date)
  if (from !== null || to !== null) {
    const start = Date.parse(`${from}T00:00:00Z`) / 1000;
    const end = Math.min(Date.parse(`${to}T00:00:00Z`) / 1000 + DAY, now + 1);
    if (start < end) return {start, end, label: `${from} to ${to}`, key: "custom", now};
    refused = `from ${from ?? "(none)"} to ${to ?? "(none)"}`;
  }
  const key = PERIODS[query.get("period")] ? query.get("period") : "week";
  const [label, startOf] = PERIODS[key];
  return {start: startOf(now), end: now + 1, label, key, now, refused};  // the API's end_time is exclusive
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
  const {start, end} = period;
  const group = GROUPS[ctx.query.get("group")] ? ctx.query.get("group") : "model";
  const bucket = ctx.query.get("bucket") ?? (end - start > 2 * DAY ? "day" : "hour");
  // Day buckets would start at the UTC midnight before a period that starts within a day (the last 24 hours).
  const width = bucket === "day" && start % DAY === 0 ? DAY : HOUR;
  const params = (groups) => usageParams({start, end, width, groups});
  // One answer by key and model serves the charts (summed by model or by key) and the table, and an ungrouped one
  // the totals and latency, so every figure on the page counts the same requests.
  const [usage, costs, overall, periodLatency, {keys}] = await Promise.all([
    buckets(ctx.api, "/v1/organization/usage/completions", params(["api_key_id", "model"])),
    buckets(ctx.api, "/v1/organization/costs", params(["api_key_id", "model"])),
    buckets(ctx.api, "/v1/organization/usage/completions", params([])),
    latencyOfPeriod(ctx.api, start, end),
    ctx.api.get("/v1/admin/keys"),
  ]);
  const names = new Map(keys.map((key) => [key.id, key.name]));
  const labelOf = (result) => group === "model" ? result.model ?? "(none)" : keyLabel(names, result.api_key_id);
  const per = width === HOUR ? "hour" : "day";

  const times = usage.map((b) => b.start_time);
  const requests = seriesOf(usage, labelOf, sent);
  // The same group keeps its colour and dash in every chart: ordered as in the requests chart.
  const order = requests.map((s) => s.label);
  const tokens = seriesOf(usage, labelOf, (r) => r.input_tokens + r.output_tokens, order);
  const cost = seriesOf(costs, labelOf, (r) => r.amount?.value ?? 0, order);
  const summary = summaryOf(overall);
  const latency = ["p50", "p95"].map((q) => ({label: q,
    values: overall.map((b) => b.results[0]?.[`latency_ms_${q}`] ?? null)}));
  const ms = (value) => value === null ? "—" : `≈ ${number(Math.round(value))} ms`;
  const timed = latency[0].values.some((v) => v !== null);  // some request of the period reached a model
  // A percentile of several buckets cannot be made from theirs: shown only when one bucket covers the period, else
  // the latency chart has each bucket's (when it has any).
  const percentile = (q) => periodLatency ? ms(periodLatency[`latency_ms_${q}`] ?? null)
    : timed ? `per ${per}, below` : "—";
  const chartOf = (id, title, series, format, integer, summed = true) => timeChart({id, title, times, series, format,
    integer, summed, bucketLabel: per});
  const shownPerHour = bucket === "day" && width === HOUR;

  return h("section", {},
    h("h1", {tabindex: "-1"}, "Usage"),
    filters(ctx, period, group, width),
    period.refused ? h("p", {class: "error", role: "alert"}, `The days in this link (${period.refused}) make no `,
      `period: ${period.label} is shown instead.`) : null,
    h("p", {class: "window"}, `From ${when(start)} to ${end > period.now ? "now" : when(end)}, per ${per}`,
      shownPerHour ? " (this period does not start at a UTC midnight, so it is shown per hour)" : "", "."),
    h("div", {class: "cards", role: "list", "aria-label": `Totals, ${period.label}`},
      card("Requests", number(summary.requests)),
      card("Input tokens", number(summary.input)),
      card("Output tokens", number(summary.output)),
      card("Cost", money(total(cost))),
      card("Error rate", summary.errors === null ? "—" : errorRate(summary.errors, summary.requests)),
      card("Latency p50", percentile("p50")),
      card("Latency p95", percentile("p95"))),
    chartOf("chart-requests", `Requests by ${GROUPS[group].toLowerCase()}`, requests, number, true),
    chartOf("chart-tokens", `Tokens (input + output) by ${GROUPS[group].toLowerCase()}`, tokens, number, true),
    chartOf("chart-cost", `Cost (USD) by ${GROUPS[group].toLowerCase()}`, cost, (v) => money(v), false),
    chartOf("chart-latency", "Latency of all requests (ms)",
      timed ? latency : [], ms, false, false),
    spendTable(usage, costs, names, period.label));
}

// The period's own latency percentiles (ungrouped), when one API bucket (an hour, or a UTC day) covers exactly the
// period; null otherwise. {} when no request of the period reached a model.
async function latencyOfPeriod(api, start, end) {
  const width = [HOUR, DAY].find((w) => start % w === 0 && end - start <= w);
  if (!width) return null;
  const [only] = await buckets(api, "/v1/organization/usage/completions", usageParams({start, end, width}));
  return only?.results[0] ?? {};
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

// A group's requests: all it sent that the gateway admitted (num_requests, Portico's addition to OpenAI's results),
// those answered from the response cache or refused by a limit included, as a key's recent requests list them.
// num_model_requests leaves out cache hits, which reach no model: a cached model would show one request of three.
const sent = (r) => r.num_requests ?? r.num_model_requests;

// Totals over the period, from ungrouped buckets. Error rate is Portico's addition too: num_errors of those requests.
function summaryOf(usage) {
  const summary = {requests: 0, input: 0, output: 0, errors: null};
  for (const bucket of usage) {
    for (const r of bucket.results) {
      summary.requests += sent(r);
      summary.input += r.input_tokens;
      summary.output += r.output_tokens;
      if (typeof r.num_errors === "number") summary.errors = (summary.errors ?? 0) + r.num_errors;
    }
  }
  return summary;
}

function spendTable(usage, costs, names, periodLabel) {
  const rows = new Map();
  const row = (r) => {
    const id = `${r.api_key_id}|${r.model}`;
    if (!rows.has(id)) rows.set(id, {key: r.api_key_id, model: r.model, ...uncounted()});
    return rows.get(id);
  };
  usage.forEach((b) => b.results.forEach((r) => {
    const entry = row(r);
    entry.counted = true;
    entry.requests += sent(r);
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
        r.key ? h("a", {href: `#/keys/${encodeURIComponent(r.key)}`, class: "name"}, keyLabel(names, r.key))
          : "(none)",
        r.model ?? "(none)", counted(r, r.requests), counted(r, r.input), counted(r, r.output), money(r.cost)]),
      {empty: "No requests in this period."}));
}

// A row's requests and tokens come from the completions usage (chat and messages); a model known only from the
// costs (images) has none there: "—", not a false 0.
const uncounted = () => ({counted: false, requests: 0, errors: 0, input: 0, output: 0, cost: 0});

// Errors among the requests (`sent`, those refused by a limit included), as a rate and a count.
export function errorRate(errors, requests) {
  return requests ? `${(100 * errors / requests).toFixed(1)} % (${number(errors)})` : "—";
}
const counted = (row, value) => row.counted ? number(value) : "—";

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
  const datesError = h("p", {class: "error", role: "alert"});
  const dates = h("div", {class: "dates", hidden: period.key !== "custom"},
    field("From (UTC)", from), field("To (UTC)", to), datesError);
  periodSelect.addEventListener("change", () => { dates.hidden = periodSelect.value !== "custom"; });
  const apply = (event) => {
    event.preventDefault();
    const query = new URLSearchParams();
    if (periodSelect.value === "custom") {
      // Days that make no period are refused here, not shown as some other period.
      const wrong = !from.value ? from : !to.value ? to : from.value > today ? from : from.value > to.value ? to : null;
      datesError.textContent = wrong ? `Choose two days, From on or before To, and From no later than ${today}.` : "";
      if (wrong) return wrong.focus();
      query.set("from", from.value);
      query.set("to", to.value);
    } else {
      query.set("period", periodSelect.value);
    }
    query.set("group", groupSelect.value);
    query.set("bucket", bucketSelect.value);
    // Enter in a select keeps the focus there, as a Keys filter just chosen does; Show's goes to the page.
    ctx.go(`#/usage?${query}`, event.type === "keydown" ? `[name="${event.target.name}"]` : null);
  };
  // Browsers submit a form on Enter in its date fields but not in its selects, where a keyboard user's Enter did
  // nothing: it applies the filters there too.
  const enter = (event) => {
    if (event.key === "Enter" && event.target instanceof HTMLSelectElement) apply(event);
  };
  return h("form", {class: "filters", "aria-label": "Usage filters", onsubmit: apply, onkeydown: enter},
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
  const requests = seriesOf(usage, labelOf, sent);
  const rows = new Map();
  const row = (model) => rows.get(model)
    ?? rows.set(model, uncounted()).get(model);
  usage.forEach((b) => b.results.forEach((r) => {
    const entry = row(labelOf(r));
    entry.counted = true;
    entry.requests += sent(r);
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
      "Cost"], sorted.map(([model, r]) => [model, counted(r, r.requests), r.counted ? errorRate(r.errors, r.requests)
      : "—", counted(r, r.input), counted(r, r.output), money(r.cost)]), {empty: "No requests in the last 7 days."}));
}

// Each model's requests, errors and cost over the last 7 days (the models page); empty without a usage API.
export async function weekByModel(api) {
  const end = Math.floor(Date.now() / 1000);
  const start = Math.floor((end - 6 * DAY) / DAY) * DAY;
  const params = usageParams({start, end, width: DAY, groups: ["model"]});
  const byModel = new Map();
  const entry = (model) => byModel.get(model) ?? byModel.set(model, {requests: 0, errors: 0, cost: 0})
    .get(model);
  try {
    const [usage, costs] = await Promise.all([buckets(api, "/v1/organization/usage/completions", params),
      buckets(api, "/v1/organization/costs", params)]);
    usage.forEach((b) => b.results.forEach((r) => {
      const e = entry(r.model);
      e.requests += sent(r);
      e.errors += r.num_errors ?? 0;
    }));
    costs.forEach((b) => b.results.forEach((r) => { entry(r.model).cost += r.amount?.value ?? 0; }));
  } catch (error) {
    if (error.status !== 404) throw error;
  }
  return byModel;
}
