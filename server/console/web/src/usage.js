// The usage page: requests, tokens and cost over a chosen period, by model or key.
import {h} from "./dom.js";

export async function usagePage(ctx) {
  return h("section", {}, h("h1", {tabindex: "-1"}, "Usage"));
}
