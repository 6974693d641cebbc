// The form that creates a key and edits one: name, environment, grants and limits.
import {field, h, money} from "./dom.js";

// [field, label, unit]: counts are whole numbers; budgets ("usd") are US dollars, exact to the micro-dollar.
export const LIMITS = [
  ["requests_per_minute", "Requests per minute", "count"],
  ["tokens_per_minute", "Tokens per minute", "count"],
  ["concurrent_requests", "Concurrent requests", "count"],
  ["daily_tokens", "Tokens per day (UTC)", "count"],
  ["daily_requests", "Requests per day (UTC)", "count"],
  ["max_spend_day", "Budget per day (USD, UTC)", "usd"],
  ["max_spend_month", "Budget per month (USD, UTC)", "usd"],
];

export const limitText = (unit, value) => unit === "usd" ? money(value) : Number(value).toLocaleString("en-US");

// models: the catalog ids to offer; envs: environment names already in use (suggested); key: the key to edit, or
// null to create one. Returns {element, read()}: read() gives the request body, or throws Error naming the problem.
export function keyForm({models, envs, key}) {
  const name = h("input", {type: "text", name: "name", required: true, maxLength: 200, value: key?.name ?? "",
    autocomplete: "off"});
  const env = h("input", {type: "text", name: "env", list: "known-envs", value: key?.env ?? "", autocomplete: "off"});
  const allModels = h("input", {type: "radio", name: "grants", value: "all", checked: key ? key.all_models : true});
  const someModels = h("input", {type: "radio", name: "grants", value: "some", checked: key ? !key.all_models : false});
  const granted = new Set(key?.models ?? []);
  const modelBoxes = [...new Set([...models, ...granted])].sort().map((id) =>
    h("input", {type: "checkbox", name: "model", value: id, checked: granted.has(id)}));
  const admin = h("input", {type: "checkbox", name: "admin"});
  const limitInputs = LIMITS.map(([limitName, , unit]) => h("input", {
    type: "number", name: limitName, min: unit === "usd" ? "0.000001" : "1", step: unit === "usd" ? "any" : "1",
    inputMode: unit === "usd" ? "decimal" : "numeric", value: key?.limits?.[limitName] ?? "", placeholder: "default",
  }));
  const syncModels = () => modelBoxes.forEach((box) => { box.disabled = allModels.checked; });
  allModels.addEventListener("change", syncModels);
  someModels.addEventListener("change", syncModels);
  syncModels();

  const element = h("div", {class: "key-form"},
    field("Name", name, "Who holds the key, e.g. billing-api."),
    field("Environment", env, "A label such as prod, staging or a business line."),
    h("datalist", {id: "known-envs"}, envs.map((value) => h("option", {value}))),
    h("fieldset", {},
      h("legend", {}, "Models"),
      h("label", {class: "choice"}, allModels, " All models, including ones added later"),
      h("label", {class: "choice"}, someModels, " Only these models:"),
      h("div", {class: "model-choices"}, modelBoxes.map((box) => h("label", {class: "choice"}, box, " ", box.value)))),
    h("fieldset", {},
      h("legend", {}, "Limits (empty: the gateway's default)"),
      h("div", {class: "limits-grid"}, limitInputs.map((input, i) => field(LIMITS[i][1], input)))),
    key ? null : h("label", {class: "choice"}, admin, " Admin key (may administer keys and use this console)"));

  function read() {
    const body = {name: name.value.trim(), env: env.value.trim()};
    if (!body.name) throw new Error("Give the key a name.");
    if (allModels.checked) {
      body.all_models = true;
    } else {
      body.all_models = false;
      body.models = modelBoxes.filter((box) => box.checked).map((box) => box.value);
      if (!body.models.length) throw new Error("Choose at least one model, or all models.");
    }
    body.limits = {};
    LIMITS.forEach(([limitName, label, unit], i) => {
      const text = limitInputs[i].value.trim();
      if (text === "") {
        if (key) body.limits[limitName] = 0;  // an update: 0 removes the key's own value, so the default applies
        return;
      }
      const value = Number(text);
      if (unit === "usd") {
        if (!(value > 0) || !/^\d+(\.\d{1,6})?$/.test(text)) {
          throw new Error(`${label} must be an amount of US dollars above 0 (at most 6 decimals), or empty.`);
        }
      } else if (!Number.isInteger(value) || value < 1 || value > 2147483647) {
        throw new Error(`${label} must be a whole number from 1 to 2147483647, or empty.`);
      }
      body.limits[limitName] = value;
    });
    if (!key) body.admin = admin.checked;
    return body;
  }

  return {element, read};
}
