// The keys page: every key, filtered by environment and state, and the form that creates one.
import {field, formDialog, h, number, showSecret, table, when} from "./dom.js";
import {keyForm, limitText, LIMITS} from "./keyform.js";

export const keyState = (key) => key.revoked_at ? "revoked" : "active";
const STATES = ["active", "revoked", "all"];
// Rows a page of the list draws: a gateway of tens of thousands of keys drew them all, and took seconds to show.
const PAGE_SIZE = 100;
// pk-, an optional env and 43 random characters (server/keys/store.py), found wherever it is in the search: one
// pasted with what came around it (`Bearer pk-...`, `OPENAI_API_KEY=pk-...`, quotes) is a secret all the same.
const SECRET = /pk-[\w-]{40,}/;

// A name as a person types it to find it: case and accents aside, as composed or decomposed. Lowercasing alone kept
// "İzmir" as "i̇zmir" (an i and a combining dot), which "izmir" is not, and "Ünïcode" from "unicode"; ß is "ss".
const folded = (text) => text.normalize("NFKD").replace(/\p{M}/gu, "").toUpperCase().toLowerCase();

export function grantsText(key) {
  return key.all_models ? "all models" : (key.models.length ? key.models.join(", ") : "none");
}

export function ownLimitsText(key) {
  const own = LIMITS.filter(([name]) => key.limits?.[name])
    .map(([name, label, unit]) => `${label}: ${limitText(unit, key.limits[name])}`);
  return own.length ? own.join("; ") : "defaults";
}

export async function catalogModels(api) {
  // The whole catalog, whatever the signed-in admin key's own grants (GET /v1/admin/models).
  const {models} = await api.get("/v1/admin/models");
  return models.map((model) => model.id);
}

export async function keysPage(ctx) {
  const [{keys}, models] = await Promise.all([ctx.api.get("/v1/admin/keys"), catalogModels(ctx.api)]);
  const envs = [...new Set(keys.map((key) => key.env).filter(Boolean))].sort();
  const envFilter = ctx.query.get("env") ?? "";
  // A bookmarked filter shows as it filters: an environment no key has (any more) is still offered, selected.
  const envChoices = envFilter && !envs.includes(envFilter) ? [...envs, envFilter].sort() : envs;
  const stateFilter = STATES.includes(ctx.query.get("state")) ? ctx.query.get("state") : "active";
  const search = folded(ctx.query.get("q") ?? "");
  const shown = keys
    .filter((key) => !envFilter || key.env === envFilter)
    .filter((key) => stateFilter === "all" || keyState(key) === stateFilter)
    .filter((key) => !search || folded(key.name).includes(search) || folded(key.id).includes(search))
    // Newest first; keys a script made in the same second by name (batch-2 before batch-10), not by random id.
    .sort((a, b) => b.created - a.created || a.name.localeCompare(b.name, "en", {numeric: true}));

  const envSelect = h("select", {name: "env"},
    h("option", {value: ""}, "All environments"),
    envChoices.map((env) => h("option", {value: env, selected: env === envFilter}, env)));
  const stateSelect = h("select", {name: "state"},
    STATES.map((state) => h("option", {value: state, selected: state === stateFilter},
      state === "all" ? "Active and revoked" : state[0].toUpperCase() + state.slice(1))));
  const searchInput = h("input", {type: "search", name: "q", value: ctx.query.get("q") ?? "", autocomplete: "off"});
  const searchError = h("p", {class: "error", role: "alert"});
  const applyFilters = (event) => {
    event.preventDefault();
    if (SECRET.test(searchInput.value.trim())) {  // the filters go into the URL, and so into the browser's history
      searchInput.value = "";
      searchError.textContent = "That is a key's secret, which the console never puts in a URL: search by the " +
        "key's name or id.";
      return searchInput.focus();
    }
    const query = new URLSearchParams();
    if (envSelect.value) query.set("env", envSelect.value);
    if (stateSelect.value !== "active") query.set("state", stateSelect.value);
    if (searchInput.value.trim()) query.set("q", searchInput.value.trim());
    // A choice made in a filter keeps the focus there, for the next arrow key; the Filter button's goes to the page.
    ctx.go(`#/keys${query.size ? "?" + query : ""}`, event.type === "change" ? `[name="${event.target.name}"]` : null);
  };
  envSelect.addEventListener("change", applyFilters);
  stateSelect.addEventListener("change", applyFilters);

  // The page in the URL, as the filters are (a bookmark, Back); past the last one, the last one.
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  const pageNumber = Math.min(pages, Math.max(1, Number.parseInt(ctx.query.get("page"), 10) || 1));
  const first = (pageNumber - 1) * PAGE_SIZE;
  const onPage = shown.slice(first, first + PAGE_SIZE);
  const pageLink = (page, text) => {
    const query = new URLSearchParams(ctx.query);
    query.set("page", page);
    return h("a", {href: `#/keys?${query}`, rel: page < pageNumber ? "prev" : "next"}, text);
  };

  const rows = onPage.map((key) => [
    // A name of spaces only (the API takes one) would be a link with nothing to see or click.
    h("a", {href: `#/keys/${encodeURIComponent(key.id)}`, class: "name"}, key.name.trim() || "(unnamed)"),
    h("code", {}, key.id),
    key.env || "—",
    keyState(key) === "revoked"
      ? h("span", {class: "badge revoked"}, "✕ revoked") : h("span", {class: "badge"}, "● active"),
    key.admin ? "admin" : "",
    grantsText(key),
    ownLimitsText(key),
    when(key.created),
  ]);

  return h("section", {},
    h("div", {class: "page-head"},
      h("h1", {tabindex: "-1"}, "Keys"),
      h("button", {type: "button", class: "primary", onclick: () => createKey(ctx, models, envs)}, "Create key")),
    h("form", {class: "filters", role: "search", "aria-label": "Filter keys", onsubmit: applyFilters},
      field("Environment", envSelect), field("State", stateSelect), field("Name or id", searchInput),
      h("button", {type: "submit"}, "Filter"), searchError),
    h("p", {class: "count"}, `${number(shown.length)} of ${number(keys.length)} key${keys.length === 1 ? "" : "s"}`,
      pages > 1 ? `: ${number(first + 1)}–${number(first + onPage.length)} shown` : ""),
    table("API keys", ["Name", "Id", "Environment", "State", "Role", "Models", "Own limits", "Created"], rows,
      {empty: "No key matches these filters."}),
    pages > 1 ? h("nav", {class: "pager", "aria-label": "Pages of keys"},
      pageNumber > 1 ? pageLink(pageNumber - 1, "Previous") : null,
      h("span", {}, `Page ${number(pageNumber)} of ${number(pages)}`),
      pageNumber < pages ? pageLink(pageNumber + 1, "Next") : null) : null);
}

async function createKey(ctx, models, envs) {
  const form = keyForm({models, envs, key: null});
  const created = await formDialog("Create a key", form.element, "Create key",
    () => ctx.api.post("/v1/admin/keys", form.read()));
  if (!created) return;
  await showSecret(`Key “${created.key.name}” created`, created.secret,
    `Its id is ${created.key.id}: logs and this console show the id, never the secret.`);
  ctx.go(`#/keys/${encodeURIComponent(created.key.id)}`);
}
