// Small DOM helpers: the console builds its pages from plain elements (no framework; see docs/console.md).

// h("a", {href: "#/keys", class: "x", onclick: fn}, "text", child, [more]) -> an element. Text is always set as text,
// never parsed as HTML, so nothing a key name holds can become markup; and shown() as text, so no direction control
// in it can reorder the text around it.
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs ?? {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name in element && typeof value !== "string") element[name] = value;
    else element.setAttribute(name, value === true ? "" : value);
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(element, child);
    else element.append(child instanceof Node ? child : shown(String(child)));
  }
}

// Text from the API with its directional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) written
// out as <U+202E>: a right-to-left override in a key name would otherwise reverse whatever follows it on the line
// (the key's id, "?" in "Revoke ...?") and disguise the name itself (Trojan Source). No name needs them to read.
export const shown = (text) => text.replace(/[\u202a-\u202e\u2066-\u2069]/g,
  (c) => `<U+${c.codePointAt(0).toString(16).toUpperCase()}>`);

let fieldCount = 0;

// A labelled form field: <label for=id>text</label> + the control (+ a hint tied to it by aria-describedby).
export function field(text, control, hint) {
  control.id ||= `field-${++fieldCount}`;
  const parts = [h("label", {for: control.id}, text), control];
  if (hint) {
    const hintId = `${control.id}-hint`;
    control.setAttribute("aria-describedby", hintId);
    parts.push(h("small", {id: hintId, class: "hint"}, hint));
  }
  return h("div", {class: "field"}, parts);
}

export function table(caption, headers, rows, {empty = "Nothing to show."} = {}) {
  if (!rows.length) return h("p", {class: "empty"}, empty);
  return h("div", {class: "table-wrap", tabindex: "0", role: "region", "aria-label": caption},
    h("table", {},
      h("caption", {}, caption),
      h("thead", {}, h("tr", {}, headers.map((text) => h("th", {scope: "col"}, text)))),
      h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((cell, i) =>
        i === 0 ? h("th", {scope: "row"}, cell) : h("td", {}, cell)))))));
}

// A modal <dialog>: the browser traps focus in it and Escape closes it. Resolves with the button's value.
export function modal(title, body, buttons) {
  return new Promise((resolve) => {
    const dialog = h("dialog", {"aria-labelledby": "dialog-title"},
      h("h2", {id: "dialog-title"}, title), body,
      h("div", {class: "actions"}, buttons.map(({text, value, kind, autofocus}) =>
        h("button", {type: "button", class: kind, autofocus, onclick: () => dialog.close(value)}, text))));
    dialog.addEventListener("close", () => { dialog.remove(); resolve(dialog.returnValue); });
    document.body.append(dialog);
    dialog.showModal();
  });
}

// A value the user must correct in `control`: formDialog shows the message, marks the control invalid and focuses it.
export class FieldError extends Error {
  constructor(control, message) {
    super(message);
    this.control = control;
  }
}

// A modal form: `submit()` returns the dialog's result (it then closes) or throws an Error whose message is shown
// in the dialog (under its field, for a FieldError), which stays open. Resolves with that result, or null when
// cancelled (button or Escape). A request on its way may have taken effect (a key created, a secret rotated): the
// form is not cancelled meanwhile, and if it is closed all the same, it resolves with that request's result.
export function formDialog(title, content, submitText, submit) {
  return new Promise((resolve) => {
    let result = null;
    let pending = false;
    let closed = false;
    const settle = () => { if (closed && !pending) resolve(result); };
    const error = h("p", {class: "error", role: "alert"});
    const submitButton = h("button", {type: "submit", class: "primary"}, submitText);
    const cancelButton = h("button", {type: "button", onclick: () => dialog.close()}, "Cancel");
    const actions = h("div", {class: "actions"}, cancelButton, submitButton);
    const form = h("form", {novalidate: true}, content, error, actions);
    const dialog = h("dialog", {"aria-labelledby": "dialog-title"}, h("h2", {id: "dialog-title"}, title), form);
    dialog.addEventListener("cancel", (event) => { if (pending) event.preventDefault(); });  // Escape
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.textContent = "";
      form.querySelectorAll("[aria-invalid]").forEach((control) => control.removeAttribute("aria-invalid"));
      pending = submitButton.disabled = cancelButton.disabled = true;
      let focus = null;  // where the focus goes once the buttons are enabled again
      try {
        result = await submit();
        dialog.close();
      } catch (problem) {
        error.textContent = shown(problem.message);
        // A FieldError's message goes under its field, as does the gateway's 400 naming one (param "env",
        // "limits.max_spend_day": the control of that name).
        const control = problem.control ?? (problem.param &&
          form.querySelector(`[name="${CSS.escape(problem.param.replace(/^limits\./, ""))}"]`));
        const place = control?.closest(".field, fieldset");
        if (place) place.append(error);
        else actions.before(error);
        control?.setAttribute("aria-invalid", "true");
        // A group (the models) cannot take the focus: its first choice does. An error of no field (a key revoked
        // meanwhile, an unreachable gateway) leaves it on the submit button, which lost it while disabled.
        focus = (control?.matches("fieldset") ? control.querySelector("input:not(:disabled)") : control)
          ?? (dialog.contains(document.activeElement) ? null : submitButton);
      } finally {
        pending = submitButton.disabled = cancelButton.disabled = false;
        focus?.focus();
        settle();
      }
    });
    dialog.addEventListener("close", () => { dialog.remove(); closed = true; settle(); });
    document.body.append(dialog);
    dialog.showModal();
  });
}

export function confirmDialog(title, message, action) {
  return modal(title, h("p", {}, message), [
    {text: "Cancel", value: "cancel", autofocus: true},
    {text: action, value: "confirm", kind: "danger"},
  ]).then((value) => value === "confirm");
}

// Shows a secret once, with a copy button; closing the dialog drops it from the page. Copy has the focus, not Done:
// the Enter that made the secret, pressed twice, would otherwise close the dialog before the secret could be read.
export function showSecret(title, secret, note) {
  const input = h("input", {type: "text", readOnly: true, value: secret, class: "secret", spellcheck: false,
    "aria-label": "Secret"});
  const copied = h("span", {role: "status", class: "hint"});
  const copy = async () => {
    let done = true;
    try {
      await navigator.clipboard.writeText(secret);
    } catch {
      input.focus();  // no clipboard API (a page not served over https or from localhost): the old way
      input.select();
      done = document.execCommand("copy");  // false when nothing was copied: then the person copies it
    }
    copied.textContent = done ? "Copied." : "Could not copy: the secret is selected, copy it with Ctrl+C (⌘C).";
  };
  return modal(title, h("div", {},
    h("p", {}, h("strong", {}, "Copy this secret now: it is shown only once and cannot be shown again."), " ", note),
    h("div", {class: "secret-row"}, input, h("button", {type: "button", onclick: copy, autofocus: true}, "Copy"),
      copied)),
  [{text: "Done", value: "done"}]);
}

export function when(unixSeconds, seconds = false) {
  if (!unixSeconds) return "—";
  return new Date(unixSeconds * 1000).toISOString().replace("T", " ").slice(0, seconds ? 19 : 16) + " UTC";
}

export const number = (value) => value === null || value === undefined ? "—" : Number(value).toLocaleString("en-US");

// Exact to the micro-dollar, as the ledger counts and `portico usage` prints: at least cents, more digits only when
// they matter ($0.000039, never a rounded $0.0000 for a cost that is not zero).
export function money(value, currency = "usd") {
  if (value === null || value === undefined) return "—";
  const [whole, fraction] = Number(value).toFixed(6).split(".");  // sums of floats: 0.00039000000000000005
  return `${currency === "usd" ? "$" : currency.toUpperCase() + " "}${Number(whole).toLocaleString("en-US")}.` +
    fraction.replace(/0+$/, "").padEnd(2, "0");
}
