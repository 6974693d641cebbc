// The admin API as the console calls it. The admin key lives only in this object, in the tab's memory: never in
// localStorage, sessionStorage, a cookie or a URL, so closing or reloading the tab signs out.

const TIMEOUT_SECONDS = 30;

export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.code = error?.code ?? null;
    this.param = error?.param ?? null;
  }
}

export class Api {
  #key = null;
  #confirmed = false;  // the gateway took the key at sign-in
  #offset = 0;  // the gateway's clock less this browser's (ms), when they differ by more than 2 s

  // Called when the gateway refuses the signed-in key (revoked, say): the console signs out at once, wherever the
  // refusal came from (a page, a form, a revocation), rather than leave a key that no longer works signed in.
  onRefused = () => {};

  get signedIn() { return this.#key !== null; }

  // Now in unix seconds by the gateway's clock, as near as its answers' Date header (whole seconds) tells: the ledger
  // is written by that clock, and a browser minutes behind it would leave requests just made out of every period.
  // Within 2 s of the browser's own clock, which is then kept as it is: finer than the header.
  now() { return (Date.now() + this.#offset) / 1000; }

  // Checks the key against the admin API before keeping it: only an admin key gets in.
  async signIn(key) {
    // A secret is plain ASCII (pk-ENV-...): anything else cannot be one, and a browser refuses to send it in a header.
    if (!/^[\x21-\x7e]+$/.test(key)) throw new ApiError(401, {message: "Not an API key."});
    this.#key = key;
    try {
      await this.request("GET", "/v1/admin/keys");
    } catch (error) {
      this.#key = null;
      throw error;
    }
    this.#confirmed = true;
  }

  signOut() {
    this.#key = null;
    this.#confirmed = false;
  }

  async request(method, path, body) {
    if (this.#key === null) throw new ApiError(401, {message: "Not signed in."});
    // A browser resolves dot segments ("/keys/../limits" is "/limits", %2E alike): never call another path than meant.
    if (new URL(path, location.origin).pathname !== path.split("?")[0]) {
      throw new ApiError(0, {message: `Not a valid admin API path: ${path}`});
    }
    const headers = {authorization: `Bearer ${this.#key}`};
    if (body !== undefined) headers["content-type"] = "application/json";
    // A hung gateway accepts the connection and never answers: a form would wait for ever, its button disabled.
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_SECONDS * 1000);
    let response, text;
    try {
      response = await fetch(path, {
        method, headers, body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer", signal: abort.signal,
      });
      text = await response.text();
    } catch {
      throw new ApiError(0, {message: abort.signal.aborted
        ? `The gateway did not answer within ${TIMEOUT_SECONDS} seconds: check that it is running, then try again.`
        : "The gateway could not be reached: check that it is running, then try again."});
    } finally {
      clearTimeout(timer);
    }
    const date = Date.parse(response.headers.get("date") ?? "");
    if (!Number.isNaN(date)) {
      const offset = date + 500 - Date.now();  // the header's second, at its middle
      this.#offset = Math.abs(offset) > 2000 ? offset : 0;
    }
    let json = null;
    try { json = text ? JSON.parse(text) : null; } catch { /* not JSON: reported below */ }
    if (response.status === 401 && this.#confirmed && this.#key !== null) {
      // The gateway's own words ("Incorrect API key provided.") would read as if the key being edited were wrong.
      this.signOut();
      this.onRefused();
      throw new ApiError(401, {message: "the admin key is no longer valid (revoked or unknown): signed out."});
    }
    if (!response.ok) throw new ApiError(response.status, json?.error ?? {message: text.slice(0, 200)});
    return json;
  }

  get(path) { return this.request("GET", path); }
  post(path, body = {}) { return this.request("POST", path, body); }
  patch(path, body) { return this.request("PATCH", path, body); }
}

export function signInMessage(error) {
  if (error.status === 401) return "That key is not valid: it is unknown, mistyped or revoked.";
  if (error.status === 403) return "That key is not an admin key: only admin keys may use the console.";
  return `Could not sign in: ${error.message}`;
}
