// The console's shell: sign-in, the navigation and a hash router (#/keys, #/keys/ID, #/usage, #/models). Routes
// live in the URL's fragment, which never leaves the browser, and hold no secret.
import {Api, ApiError, signInMessage} from "./api.js";
import {field, h, shown} from "./dom.js";
import {keyPage} from "./key.js";
import {keysPage} from "./keys.js";
import {modelsPage} from "./models.js";
import {usagePage} from "./usage.js";

const ROUTES = [
  [/^\/keys$/, keysPage],
  [/^\/keys\/([^/]+)$/, keyPage],
  [/^\/usage$/, usagePage],
  [/^\/models$/, modelsPage],
];

class Console {
  constructor() {
    this.api = new Api();
    this.api.onRefused = () => this.signOut("Signed out: the admin key is no longer valid.");
    this.main = document.getElementById("main");
    this.nav = document.getElementById("nav");
    this.status = document.getElementById("status");
    this.signOutButton = document.getElementById("sign-out");
    this.signOutButton.addEventListener("click", () => this.signOut("Signed out."));
    // A message is about the page it was shown on ("Revoked key x."): above the next page, it would seem about that.
    window.addEventListener("hashchange", () => { this.notify(""); this.render(); });
    // The link to the page shown changes no hash, and the browser would do nothing: it loads the page again (one
    // the gateway could not answer, say), as it does in a site of pages.
    this.nav.addEventListener("click", (event) => {
      const modified = event.ctrlKey || event.metaKey || event.shiftKey || event.altKey;  // a new tab or window
      if (modified || event.target.closest("a")?.getAttribute("href") !== location.hash) return;
      event.preventDefault();
      this.notify("");
      this.render();
    });
    // A page left for another stays whole in the browser's back/forward cache, key included: Back would bring it
    // back signed in, for whoever uses the browser next. Leaving signs out, as reloading or closing the tab does.
    window.addEventListener("pagehide", () => {
      if (this.api.signedIn) this.signOut("Signed out: you left the console.");
    });
  }

  notify(text) { this.status.textContent = shown(text); }

  signOut(message) {
    this.api.signOut();
    // An open form or secret dialog belongs to the session that ended (it resolves as cancelled).
    document.querySelectorAll("dialog[open]").forEach((dialog) => dialog.close());
    this.notify(message);
    this.render();
  }

  async render() {
    // A later render (another page, or the sign-in form after signing out) wins over a slow earlier one, whose
    // data must not appear once no one is signed in.
    const rendered = this.rendered = Symbol("render");
    // Taken now, for this render only: a filter's next choice, made while this page's list was on its way, asks for
    // the focus on the render it starts, which this one (shown first, then replaced) would otherwise have used up.
    const focus = this.focusAfter;
    this.focusAfter = null;
    const signedIn = this.api.signedIn;
    this.nav.hidden = this.signOutButton.hidden = !signedIn;
    if (!signedIn) return this.show(this.signInForm());
    const [path, search] = (location.hash.slice(1) || "/keys").split("?");
    for (const link of this.nav.querySelectorAll("a")) {
      const current = path.startsWith(link.getAttribute("href").slice(1));
      if (current) link.setAttribute("aria-current", "page"); else link.removeAttribute("aria-current");
    }
    const route = ROUTES.find(([pattern]) => pattern.test(path));
    if (!route) return this.go("#/keys");
    const args = path.match(route[0]).slice(1).map(decoded);
    const ctx = {
      api: this.api, query: new URLSearchParams(search ?? ""),
      go: (hash, focus) => this.go(hash, focus), notify: (text) => this.notify(text), refresh: () => this.render(),
    };
    this.main.setAttribute("aria-busy", "true");
    // Told at once, above the page being left, until the new one is shown (a month per hour may take a while).
    if (!this.main.querySelector(".loading")) this.main.prepend(h("p", {class: "loading"}, "Loading…"));
    let page;
    try {
      page = await route[1](ctx, ...args);
    } catch (error) {
      if (rendered !== this.rendered || !this.api.signedIn) return;  // left, or signed out (told why) meanwhile
      if (error instanceof ApiError && error.status === 401) {
        return this.signOut("Signed out: the admin key is no longer valid.");
      }
      // Reloading would sign out: the page asks again from here, once the gateway is back.
      page = h("section", {}, h("h1", {tabindex: "-1"}, "Something went wrong"),
        h("p", {class: "error", role: "alert"}, error.message),
        h("button", {type: "button", onclick: () => this.render()}, "Try again"));
    }
    if (rendered === this.rendered && this.api.signedIn) this.show(page, focus);
  }

  // focus: a selector for the control to give the focus to (see go), rather than the page's heading.
  show(page, focus = null) {
    // A filter's choice keeps the focus on a filter: on the one the user tabbed on to while the list loaded, if any.
    const movedTo = focus && this.main.contains(document.activeElement) && document.activeElement.name;
    if (movedTo) focus = `[name="${CSS.escape(movedTo)}"]`;
    this.main.replaceChildren(page);
    this.main.removeAttribute("aria-busy");
    const heading = page.querySelector("h1");
    // The tab, the history list and a screen reader tell pages apart by their title.
    document.title = heading ? `${heading.textContent} — Portico console` : "Portico console";
    const control = focus && page.querySelector(focus);
    (control || heading || this.main).focus();
  }

  // focus: a selector for the control to keep the focus on the page shown next (a filter, whose arrow keys would
  // otherwise apply one step and leave the focus on the heading), rather than its heading.
  go(hash, focus = null) {
    this.focusAfter = focus;
    if (location.hash === hash) this.render(); else location.hash = hash;
  }

  signInForm() {
    const key = h("input", {type: "password", name: "admin-key", autocomplete: "off", required: true,
      spellcheck: false});
    const error = h("p", {class: "error", role: "alert"});
    const submit = async (event) => {
      event.preventDefault();
      error.textContent = "";
      try {
        await this.api.signIn(pastedKey(key.value));
      } catch (problem) {
        error.textContent = shown(problem instanceof ApiError ? signInMessage(problem) : problem.message);
        key.select();
        return;
      }
      key.value = "";
      this.notify("Signed in.");
      this.render();
    };
    return h("section", {class: "sign-in"},
      h("h1", {tabindex: "-1"}, "Sign in"),
      h("p", {}, "Sign in with an admin key (",
        h("code", {}, "portico keys create --name ops --all-models --admin"), "). The key stays in ",
        "this tab's memory only: closing or reloading the tab signs you out."),
      h("form", {onsubmit: submit}, field("Admin key", key), error,
        h("button", {type: "submit", class: "primary"}, "Sign in")));
  }
}

// A route's part as typed: a stray "%" (#/keys/50%) is taken as it is rather than failing the page.
function decoded(part) {
  try {
    return decodeURIComponent(part);
  } catch {
    return part;
  }
}

// The key in what a person pasted: copied from a curl command or a request's headers, it may come with its header's
// name or its scheme (`Authorization: Bearer pk-...`); no key holds a space, so what precedes the key is not its part.
function pastedKey(text) {
  return text.trim().replace(/^(?:(?:authorization|x-api-key)\s*:\s*)?(?:bearer\s+)?/i, "");
}

new Console().render();
