// The usage page: requests, tokens and cost per hour or day, by model or by key, for a chosen period, read from
// the OpenAI-shaped usage API (/v1/organization/usage/completions and /v1/organization/costs).
import {timeChart} from "./chart.js";
import {field, h, money, number, table, when} from "./dom.js";

const HOUR = 3600;
const DAY = 86400;
const WHOLE = "all";
const COMPLETIONS = "/v1/organization/usage/completions";
const COSTS = "/v1/organization/costs";
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
// A day as typed (2026-11-28) to its UTC midnight, or NaN: not a date, or a day its month has not (the browser's parser
// reads February 30 as March 2, and the page would name one day over another's figures).
const dayStart = (day) => {
  const time = Date.parse(`${day}T00:00:00Z`);
  return !Number.isNaN(time) && new Date(time).toISOString().slice(0, 10) === day ? time / 1000 : NaN;
};
const startOfDay = (seconds) => Math.floor(seconds / DAY) * DAY;
const GROUPS = {model: "Model", api_key_id: "Key"};
const EPOCH = "1970-01-01";  // the usage API's times are unix seconds from 0
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

// width: HOUR, DAY or WHOLE (Portico's bucket_width "all": one bucket for the whole period, so a period's totals per
// key and model are one result each, not one a day).
// end: null for now, as the gateway's clock has it (a period that ends now).
export function usageParams({start, end, width, groups = [], keyIds = [], models = []}) {
  const params = [["start_time", start], ...(end === null ? [] : [["end_time", end]]),
    ...(width === WHOLE ? [["bucket_width", "all"]] : [["bucket_width", width === HOUR ? "1h" : "1d"],
      ["limit", width === HOUR ? 168 : 31]])];
  groups.forEach((group) => params.push(["group_by", group]));
  keyIds.forEach((id) => params.push(["api_key_ids", id]));
  models.forEach((model) => params.push(["models", model]));
  return params;
}

// The period the page shows: a preset ending now, or whole UTC days from..to (inclusive). `now`: the gateway's.
// asked: its end as asked for, null when it ends now (the gateway's now, which the API's end_time defaults to).
function periodOf(query, now) {
  const from = query.get("from"), to = query.get("to");
  let refused = null;  // days in the link that make no period (To before From, a day to come, not a date)
  if (from !== null || to !== null) {
    const start = dayStart(from);
    const end = Math.min(dayStart(to) + DAY, now + 1);
    if (start >= 0 && start < end) {  // 0: 1970
      return {start, end, asked: end > now ? null : end, label: `${from} to ${to}`, key: "custom", now};
    }
    refused = `from ${from ?? "(none)"} to ${to ?? "(none)"}`;
  }
  const key = PERIODS[query.get("period")] ? query.get("period") : "week";
  const [label, startOf] = PERIODS[key];
  return {start: startOf(now), end: now + 1, asked: null, label, key, now, refused};  // end_time is exclusive
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
  const period = periodOf(ctx.query, Math.floor(ctx.api.now()));
  const {start, end} = period;
  const group = GROUPS[ctx.query.get("group")] ? ctx.query.get("group") : "model";
  const bucket = ctx.query.get("bucket") ?? (end - start > 2 * DAY ? "day" : "hour");
  // Day buckets would start at the UTC midnight before a period that starts within a day (the last 24 hours).
  const width = bucket === "day" && start % DAY === 0 ? DAY : HOUR;
  const by = group === "model" ? "model" : "api_key_id";
  const ask = (path, options) => buckets(ctx.api, path, usageParams({start, end: period.asked, ...options}));
  // Each figure asks for what it shows, so the answers grow with buckets, keys and models, not their product (every
  // bucket by key and model was 106 MB for 30 days of 2,200 keys): the period's totals by key and model in one
  // bucket (the table and the cost card, and which groups the charts draw), each bucket of the few groups drawn, then
  // each bucket's totals (the other cards, latency, and the charts' "other").
  const [pairUsage, pairCosts, {keys}] = await Promise.all([
    ask(COMPLETIONS, {width: WHOLE, groups: ["api_key_id", "model"]}),
    ask(COSTS, {width: WHOLE, groups: ["api_key_id", "model"]}),
    ctx.api.get("/v1/admin/keys"),
  ]);
  const names = new Map(keys.map((key) => [key.id, key.name]));
  const labelOf = (result) => group === "model" ? result.model ?? "(none)" : keyLabel(names, result.api_key_id);
  const per = width === HOUR ? "hour" : "day";
  const totalsOf = (answer, valueOf) => totalsBy(answer, labelOf, (r) => r[by], valueOf);
  const requestsDrawn = drawn(totalsOf(pairUsage, sent), []);
  // The same group keeps its colour and dash in every chart: ordered as in the requests chart.
  const costDrawn = drawn(totalsOf(pairCosts, micros),
    [...requestsDrawn.labels, ...requestsDrawn.other ? ["other"] : []]);
  // Every group drawn: all buckets by group; else only the drawn groups' (others' are the rest of each bucket).
  const eachBucket = (path, {labels, values, other}) => labels.length === 0 ? [] : ask(path, {width, groups: [by],
    ...other && values.every((v) => typeof v === "string") ? {[by === "model" ? "models" : "keyIds"]: values} : {}});
  const [usage, costs] = await Promise.all([eachBucket(COMPLETIONS, requestsDrawn), eachBucket(COSTS, costDrawn)]);
  // Each bucket's totals are read after the drawn groups' buckets, never before: requests keep being written into
  // the period meanwhile (a request is written when it ends), and a total read first was less than the drawn groups'
  // sum, "other" (the total less theirs) then negative. Read after, "other" may hold a request that has just ended.
  const [overallCosts, overall, periodLatency] = await Promise.all([costDrawn.other ? ask(COSTS, {width}) : [],
    ask(COMPLETIONS, {width}), latencyOfPeriod(ctx.api, period)]);

  const times = overall.map((b) => b.start_time);
  const requests = seriesOf(requestsDrawn, times, usage, overall, labelOf, sent);
  const tokens = seriesOf(requestsDrawn, times, usage, overall, labelOf, (r) => r.input_tokens + r.output_tokens);
  const cost = seriesOf(costDrawn, times, costs, overallCosts, labelOf, micros)
    .map((s) => ({label: s.label, values: s.values.map((v) => v / 1e6)}));
  const summary = summaryOf(overall);
  const latency = ["p50", "p95"].map((q) => ({label: q,
    values: overall.map((b) => b.results[0]?.[`latency_ms_${q}`] ?? null)}));
  const ms = (value) => value === null ? "—" : `≈ ${number(Math.round(value))} ms`;
  const timed = latency[0].values.some((v) => v !== null);  // some request of the period reached a model
  // A percentile of several buckets cannot be made from theirs: shown only when one bucket covers the period, else
  // the latency chart has each bucket's (when it has any).
  const percentile = (q) => periodLatency ? ms(periodLatency[`latency_ms_${q}`] ?? null)
    : timed ? `per ${per}, below` : "—";
  const chartOf = (id, title, series, format, unit, summed = true) => timeChart({id, title, times, series, format,
    unit, summed, bucketLabel: per});
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
      card("Cost", money(sumOf(pairCosts, micros) / 1e6)),
      card("Error rate", summary.errors === null ? "—" : errorRate(summary.errors, summary.requests)),
      card("Latency p50", percentile("p50")),
      card("Latency p95", percentile("p95"))),
    chartOf("chart-requests", `Requests by ${GROUPS[group].toLowerCase()}`, requests, number, "count"),
    chartOf("chart-tokens", `Tokens (input + output) by ${GROUPS[group].toLowerCase()}`, tokens, number, "count"),
    chartOf("chart-cost", `Cost (USD) by ${GROUPS[group].toLowerCase()}`, cost, (v) => money(v), "usd"),
    chartOf("chart-latency", "Latency of all requests (ms)",
      timed ? latency : [], ms, null, false),
    spendTable(pairUsage, pairCosts, names, period.label));
}

// The period's own latency percentiles (ungrouped), when one API bucket (an hour, or a UTC day) covers exactly the
// period; null otherwise. {} when no request of the period reached a model.
async function latencyOfPeriod(api, {start, end, asked}) {
  const width = [HOUR, DAY].find((w) => start % w === 0 && end - start <= w);
  if (!width) return null;
  const [only] = await buckets(api, COMPLETIONS, usageParams({start, end: asked, width}));
  return only?.results[0] ?? {};
}

function keyLabel(names, id) {
  if (!id) return "(none)";
  return names.has(id) ? `${names.get(id)} (${id})` : id;
}

// Each group's total over the answer's buckets, with the API's values it stands for (`rawOf`).
function totalsBy(answer, labelOf, rawOf, valueOf) {
  const totals = new Map();
  answer.forEach((bucket) => bucket.results.forEach((result) => {
    const label = labelOf(result);
    if (!totals.has(label)) totals.set(label, {value: 0, values: new Set()});
    totals.get(label).value += valueOf(result);
    totals.get(label).values.add(rawOf(result));
  }));
  return totals;
}

// The groups a chart draws, largest first (those in `order` first, in its order); past MAX_SERIES, the first
// MAX_SERIES - 1 and "other" for the rest. `values`: what the API calls them, to ask for their buckets alone.
function drawn(totals, order) {
  const rank = (label) => order.includes(label) ? order.indexOf(label) : order.length;
  const labels = [...totals.keys()].sort((a, b) => rank(a) - rank(b) || totals.get(b).value - totals.get(a).value);
  const other = labels.length > MAX_SERIES;
  const shown = other ? labels.slice(0, MAX_SERIES - 1) : labels;
  return {labels: shown, other, values: shown.flatMap((label) => [...totals.get(label).values])};
}

// A value per time for each drawn group, from their buckets (`bucketList`), and "other": each bucket's total (from
// `overall`, ungrouped, asked for only then) less theirs.
function seriesOf({labels, other}, times, bucketList, overall, labelOf, valueOf) {
  const at = new Map(times.map((time, i) => [time, i]));
  const series = labels.map((label) => ({label, values: new Array(times.length).fill(0)}));
  bucketList.forEach((bucket) => bucket.results.forEach((result) => {
    const index = labels.indexOf(labelOf(result));
    if (index >= 0) series[index].values[at.get(bucket.start_time)] += valueOf(result);
  }));
  if (!other) return series;
  const rest = new Array(times.length).fill(0);
  overall.forEach((bucket) => { rest[at.get(bucket.start_time)] += sumOf([bucket], valueOf); });
  series.forEach((s) => s.values.forEach((value, i) => { rest[i] -= value; }));
  return [...series, {label: "other", values: rest}];
}

const sumOf = (bucketList, valueOf) => bucketList.reduce((sum, bucket) => sum
  + bucket.results.reduce((a, r) => a + valueOf(r), 0), 0);

// A cost in micro-dollars, exact: "other" is a difference of sums, which in dollars could be -0.0000000001.
const micros = (r) => r.amount_microdollars ?? Math.round((r.amount?.value ?? 0) * 1e6);

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
  const today = new Date(period.now * 1000).toISOString().slice(0, 10);  // by the gateway's clock
  const from = h("input", {type: "date", name: "from", value: ctx.query.get("from") ?? today, min: EPOCH, max: today});
  const to = h("input", {type: "date", name: "to", value: ctx.query.get("to") ?? today, min: EPOCH, max: today});
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
      const wrong = !from.value ? from : !to.value ? to : from.value > today || from.value < EPOCH ? from
        : from.value > to.value ? to : null;
      datesError.textContent = wrong ? `Choose two days, From on or before To, and From no later than ${today} ` +
        `and no earlier than ${EPOCH}.` : "";
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

// Today and the 6 UTC days before it, up to now included: without an end_time the API counts up to the gateway's
// now, this second included (a request made in it is already in the key's recent requests).
function lastSevenDays(api) {
  return {start: startOfDay(Math.floor(api.now())) - 6 * DAY, end: null};  // up to the gateway's now
}

// A key's last 7 days by model (its page): requests per day as a chart, and totals with their cost.
export async function keyUsage(api, keyId) {
  const {start, end} = lastSevenDays(api);
  const params = usageParams({start, end, width: DAY, groups: ["model"], keyIds: [keyId]});
  let usage, costs;
  try {
    [usage, costs] = await Promise.all([buckets(api, COMPLETIONS, params),
      buckets(api, COSTS, params)]);
  } catch (error) {
    if (error.status !== 404) throw error;
    return h("p", {class: "empty"}, "This gateway has no usage API.");
  }
  const labelOf = (r) => r.model ?? "(none)";
  const times = usage.map((b) => b.start_time);
  const requests = seriesOf(drawn(totalsBy(usage, labelOf, labelOf, sent), []), times, usage, usage, labelOf, sent);
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
    timeChart({id: "chart-key-requests", title: "Requests per day by model", times,
      series: requests, format: number, unit: "count", bucketLabel: "day"}),
    table("The key's use of each model, last 7 days", ["Model", "Requests", "Errors", "Input tokens", "Output tokens",
      "Cost"], sorted.map(([model, r]) => [model, counted(r, r.requests), r.counted ? errorRate(r.errors, r.requests)
      : "—", counted(r, r.input), counted(r, r.output), money(r.cost)]), {empty: "No requests in the last 7 days."}));
}

// Each model's requests, errors and cost over the last 7 days (the models page); empty without a usage API.
export async function weekByModel(api) {
  const {start, end} = lastSevenDays(api);
  const params = usageParams({start, end, width: DAY, groups: ["model"]});
  const byModel = new Map();
  const entry = (model) => byModel.get(model) ?? byModel.set(model, {requests: 0, errors: 0, cost: 0})
    .get(model);
  try {
    const [usage, costs] = await Promise.all([buckets(api, COMPLETIONS, params),
      buckets(api, COSTS, params)]);
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
