// A key's page: what it is, its grants and limits, and the actions on it (edit, rotate, revoke).
import {ApiError} from "./api.js";
import {confirmDialog, field, formDialog, h, money, number, showSecret, table, when} from "./dom.js";
import {keyForm, limitText, LIMITS, wholeNumber} from "./keyform.js";
import {catalogModels, grantsText, keyState} from "./keys.js";
import {keyUsage} from "./usage.js";

const RECENT = 25;
const MAX_GRACE = 315360000;  // ten years: the gateway refuses a longer rotation grace (api.md, Key administration)

export async function keyPage(ctx, id) {
  // No URL path segment can hold these (a browser resolves "." and "..", escaped or not), so no key has them.
  if (id === "." || id === "..") throw new ApiError(404, {message: `No key with id '${id}'.`});
  const path = `/v1/admin/keys/${encodeURIComponent(id)}`;
  const [{key}, {keys}, models, status, usage, recent] = await Promise.all([
    ctx.api.get(path), ctx.api.get("/v1/admin/keys"), catalogModels(ctx.api), standing(ctx.api, `${path}/limits`),
    keyUsage(ctx.api, id),
    ctx.api.get(`/v1/organization/requests?api_key_ids=${encodeURIComponent(id)}&limit=${RECENT}`)]);
  const envs = [...new Set(keys.map((other) => other.env).filter(Boolean))].sort();
  const revoked = keyState(key) === "revoked";

  const edit = async () => {
    const form = keyForm({models, envs, key});
    const saved = await formDialog(`Edit “${key.name}”`, form.element, "Save",
      () => ctx.api.patch(path, form.read()));
    if (saved) {
      ctx.notify(`Saved key ${saved.key.name}.`);  // as renamed
      ctx.refresh();
    }
  };
  const rotate = async () => {
    const grace = h("input", {type: "text", name: "grace_seconds", inputMode: "numeric", autocomplete: "off",
      placeholder: "the gateway's default"});
    let graceSeconds = null;
    let refused = false;  // by the gateway: the page may be out of date (the key revoked meanwhile, say)
    const rotated = await formDialog(`Rotate “${key.name}”`, h("div", {},
      h("p", {}, "The key gets a new secret. The current secret keeps working for the grace period, so its holder ",
        "can switch without an outage."),
      field("Grace period in seconds", grace, "0 ends the current secret at once; empty: the gateway's default.")),
    "Rotate", () => {
      graceSeconds = wholeNumber(grace, "The grace period (seconds)", 0, MAX_GRACE);
      return ctx.api.post(`${path}/rotate`, graceSeconds === null ? {} : {grace_seconds: graceSeconds})
        .catch((error) => { refused = error.status >= 400; throw error; });
    });
    if (!rotated) {
      if (refused) ctx.refresh();
      return;
    }
    // A grace of 0 ends the previous secret now: "works until" the current minute would read as a last minute.
    await showSecret(`New secret for “${key.name}”`, rotated.secret, graceSeconds === 0
      ? "The previous secret stops working within seconds."
      : `The previous secret works until ${when(rotated.previous_secret_expires, true)}.`);
    ctx.refresh();
  };
  const revoke = async () => {
    const sure = await confirmDialog(`Revoke “${key.name}”?`,
      `Every secret of key ${key.id} stops working within seconds and cannot be restored; its holder gets 401 ` +
      "errors until given a new key.", "Revoke key");
    if (!sure) return;
    try {
      await ctx.api.post(`${path}/revoke`);
    } catch (error) {
      ctx.notify(`Could not revoke key ${key.name}: ${error.message}`);
      return;
    }
    ctx.notify(`Revoked key ${key.name}.`);
    ctx.refresh();
  };

  // A default is told with its value, from the limits in force (the key's own ones, not a model's): "gateway default"
  // alone would not say whether there is one.
  const inForce = new Map((status.limits ?? []).filter((s) => !s.model).map((s) => [s.limit, s.value]));
  const defaultText = (name, unit) => !status.limits ? "" : `${inForce.has(name) ? limitText(unit, inForce.get(name))
    : unit === "usd" ? "no budget" : "no limit"} `;
  const limitRows = LIMITS.map(([name, label, unit]) => [label, key.limits?.[name]
    ? `${limitText(unit, key.limits[name])} (its own)` : `${defaultText(name, unit)}(gateway default)`]);
  const labels = Object.fromEntries(LIMITS);
  const amount = (s, value) => limitText(s.unit === "usd" ? "usd" : "count", value);
  return h("section", {},
    h("p", {class: "crumbs"}, h("a", {href: "#/keys"}, "Keys"), " / ", key.id),
    h("div", {class: "page-head"},
      h("h1", {tabindex: "-1"}, key.name.trim() || key.id),  // a name of spaces only: an empty heading
      // A revoked key has no secret to rotate or revoke, but may still be renamed (its name labels its spend).
      h("div", {class: "actions"},
        h("button", {type: "button", onclick: edit}, "Edit"),
        revoked ? null : h("button", {type: "button", onclick: rotate}, "Rotate secret"),
        revoked ? null : h("button", {type: "button", class: "danger", onclick: revoke}, "Revoke"))),
    h("dl", {class: "facts"},
      h("dt", {}, "Id"), h("dd", {}, h("code", {}, key.id)),
      h("dt", {}, "State"), h("dd", {}, revoked ? `✕ revoked ${when(key.revoked_at)}` : "● active"),
      h("dt", {}, "Environment"), h("dd", {}, key.env || "—"),
      h("dt", {}, "Role"), h("dd", {}, key.admin ? "admin" : "caller"),
      h("dt", {}, "Models"), h("dd", {}, grantsText(key)),
      h("dt", {}, "Created"), h("dd", {}, when(key.created))),
    h("h2", {}, "Limits"),
    h("dl", {class: "facts limits"}, limitRows.map(([label, value]) => [h("dt", {}, label), h("dd", {}, value)])),
    h("h2", {}, "Left now"),
    status.unreadable ? h("p", {class: "error", role: "alert"}, status.unreadable) : table(
      "What the key has used and has left of each limit in force", ["Limit", "Models", "Used", "Left", "Resets in"],
      status.limits.filter((s) => mayCall(key, s.model)).map((s) => [
        labels[s.limit] ?? s.limit,
        s.model ? `on ${s.model}` : "all its models",
        h("span", {class: "use"}, h("meter", {min: 0, max: s.value, value: s.used, high: s.value * 0.8,
          "aria-hidden": "true"}), ` ${amount(s, s.used)} of ${amount(s, s.value)}`),
        amount(s, s.remaining),
        s.reset_seconds > 0 ? duration(s.reset_seconds) : "—",
      ]), {empty: "No limit applies to this key."}),
    usage,
    h("h2", {}, "Recent requests"),
    recentTable(recent));
}

// The key's limits standing, or {unreadable: why} when the limit store (Redis) is down: the rest of the page, from
// the key store, still shows the key and lets a leaked one be revoked.
async function standing(api, path) {
  try {
    return await api.get(path);
  } catch (error) {
    if (error.status !== 503) throw error;
    return {unreadable: `What the key has used and has left cannot be read now: ${error.message}`};
  }
}

// A per-model limit applies to a key only on a model it may call (the API lists every configured one).
const mayCall = (key, model) => !model || key.all_models || key.models.includes(model);

function duration(reset) {
  const seconds = Math.ceil(reset);  // whole seconds first: 119.3 is 2 min 0 s, not 1 min 60 s
  if (seconds < 60) return `${seconds} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${seconds % 60} s`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
  return `${Math.floor(seconds / 86400)} d ${Math.floor((seconds % 86400) / 3600)} h`;  // a month's budget
}

// The newest requests from the usage ledger (GET /v1/organization/requests): what each cost and how it ended (no
// prompt or answer is kept).
function recentTable(recent) {
  const rows = recent.data.map((r) => [
    new Date(r.created * 1000).toISOString().replace("T", " ").slice(0, 19),
    r.model || "—",
    r.status < 400 && !r.code ? `${r.status} ok` : `${r.status} ${r.code}`,
    r.images ? `${number(r.images)} image${r.images === 1 ? "" : "s"}`
      : `${number(r.input_tokens)} / ${number(r.output_tokens)}`,
    money(r.cost?.value ?? 0),
    `${number(Math.round(r.latency_ms))} ms`,
    h("code", {}, r.request_id),
  ]);
  return table(`The key's last ${RECENT} requests, newest first`,
    ["Time (UTC)", "Model", "Status", "Tokens in / out, images", "Cost", "Latency", "Request id"], rows,
    {empty: "No requests yet."});
}
