// The form that creates a key and edits one: name, environment, grants and limits.
import {field, FieldError, h, money} from "./dom.js";

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

const MAX_COUNT = 2147483647;
const MAX_DOLLARS = 1000000000;  // the gateway's largest budget (api.md, Key administration)

// A field's text as a whole number from `min` to `max`, or null when empty. Anything else (100e, 1,5, 0x10) is a
// FieldError: a typo must never quietly read as "empty", i.e. "no limit" or "the default".
export function wholeNumber(input, label, min, max = MAX_COUNT) {
  const text = input.value.trim();
  if (text === "") return null;
  const value = /^\d+$/.test(text) ? Number(text) : NaN;
  if (!(value >= min && value <= max)) {
    throw new FieldError(input, `${label} must be a whole number from ${min} to ${max}, or empty.`);
  }
  return value;
}

// US dollars with a point for decimals: a comma is refused, not guessed (1,5 could mean 1.5 or 15).
function dollars(input, label) {
  const text = input.value.trim();
  if (text === "") return null;
  if (!/^\d+(\.\d{1,6})?$/.test(text) || !(Number(text) > 0 && Number(text) <= MAX_DOLLARS)) {
    throw new FieldError(input, `${label} must be an amount of US dollars above 0 and at most ${MAX_DOLLARS}, ` +
      "written like 12.50 (a point for decimals, at most 6 of them, no commas), or empty.");
  }
  return Number(text);
}

// models: the catalog ids to offer; envs: environment names already in use (suggested); key: the key to edit, or
// null to create one. Returns {element, read()}: read() gives the request body, or throws Error naming the problem.
export function keyForm({models, envs, key}) {
  // No maxLength: it counts UTF-16 units (an emoji is two), cut a valid name of 150 emoji to 100 and a pasted name
  // over 200 characters to 200, without a word. The gateway's 400 for a long name is told at this field.
  const name = h("input", {type: "text", name: "name", required: true, value: key?.name ?? "", autocomplete: "off"});
  const env = h("input", {type: "text", name: "env", list: "known-envs", value: key?.env ?? "", autocomplete: "off"});
  const allModels = h("input", {type: "radio", name: "grants", value: "all", checked: key ? key.all_models : true});
  const someModels = h("input", {type: "radio", name: "grants", value: "some", checked: key ? !key.all_models : false});
  const granted = new Set(key?.models ?? []);
  const modelBoxes = [...new Set([...models, ...granted])].sort().map((id) =>
    h("input", {type: "checkbox", name: "model", value: id, checked: granted.has(id)}));
  const admin = h("input", {type: "checkbox", name: "admin"});
  // Text fields read by wholeNumber() and dollars(): a type=number field's value is "" for text it cannot parse.
  const limitInputs = LIMITS.map(([limitName, , unit]) => h("input", {
    type: "text", name: limitName, inputMode: unit === "usd" ? "decimal" : "numeric", autocomplete: "off",
    value: key?.limits?.[limitName] || "", placeholder: "default",
  }));
  const syncModels = () => modelBoxes.forEach((box) => { box.disabled = allModels.checked; });
  allModels.addEventListener("change", syncModels);
  someModels.addEventListener("change", syncModels);
  syncModels();

  // Named as the API's param for grants ("models"): its 400, and "choose one" below, are shown in this group.
  const modelChoices = h("fieldset", {name: "models"},
    h("legend", {}, "Models"),
    h("label", {class: "choice"}, allModels, " All models, including ones added later"),
    h("label", {class: "choice"}, someModels, " Only these models:"),
    h("div", {class: "model-choices"}, modelBoxes.map((box) => h("label", {class: "choice"}, box, " ", box.value))));
  const element = h("div", {class: "key-form"},
    field("Name", name, "Who holds the key, e.g. billing-api."),
    field("Environment", env, "A label such as prod, staging or a business line."),
    h("datalist", {id: "known-envs"}, envs.map((value) => h("option", {value}))),
    modelChoices,
    h("fieldset", {},
      h("legend", {}, "Limits (empty: the gateway's default)"),
      h("div", {class: "limits-grid"}, limitInputs.map((input, i) => field(LIMITS[i][1], input)))),
    key ? null : h("label", {class: "choice"}, admin, " Admin key (may administer keys and use this console)"));

  function read() {
    // A name left as the key has it is kept whole, spaces around it or only spaces (the API takes both): not sent
    // trimmed, which would rename the key when only a limit was changed, nor refused as blank.
    const untouched = key !== null && name.value === key.name;
    const body = {name: untouched ? key.name : name.value.trim(), env: env.value.trim()};
    if (!untouched && !body.name) throw new FieldError(name, "Give the key a name.");
    if (allModels.checked) {
      body.all_models = true;
    } else {
      body.all_models = false;
      body.models = modelBoxes.filter((box) => box.checked).map((box) => box.value);
      if (!body.models.length) {  // told in the models' group, with the focus on the first one to choose
        throw new FieldError(modelBoxes[0] ?? modelChoices, "Choose at least one model, or all models.");
      }
    }
    body.limits = {};
    LIMITS.forEach(([limitName, label, unit], i) => {
      const value = unit === "usd" ? dollars(limitInputs[i], label) : wholeNumber(limitInputs[i], label, 1);
      // Only an empty field means the default: on an update, 0 removes the key's own value.
      if (value !== null) body.limits[limitName] = value;
      else if (key) body.limits[limitName] = 0;
    });
    if (!key) body.admin = admin.checked;
    return key ? changes(key, body) : body;
  }

  return {element, read};
}

// An update sends only what its form changed (the API changes only what a request sets): a field sent as the page
// read it would undo what another operator changed since, a budget just set removed by a rename.
function changes(key, body) {
  const update = {limits: {}};
  if (body.name !== key.name) update.name = body.name;
  if (body.env !== (key.env ?? "")) update.env = body.env;
  const granted = [...(key.models ?? [])].sort().join("\n");
  if (body.all_models !== key.all_models || (!body.all_models && [...body.models].sort().join("\n") !== granted)) {
    update.all_models = body.all_models;
    if (!body.all_models) update.models = body.models;
  }
  for (const [name, value] of Object.entries(body.limits)) {
    if (value !== (key.limits?.[name] || 0)) update.limits[name] = value;
  }
  return update;
}
