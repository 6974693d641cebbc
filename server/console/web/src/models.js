// The models page: the catalog, each model with the path it is called through.
import {h, table, when} from "./dom.js";

export async function modelsPage(ctx) {
  const listed = await ctx.api.get("/v1/models");
  const rows = listed.data.map((model) => [h("code", {}, model.id), model.endpoint, model.owned_by, when(model.created)]);
  return h("section", {},
    h("h1", {tabindex: "-1"}, "Models"),
    table("Models", ["Model", "Endpoint", "Owned by", "Created"], rows, {empty: "No models."}));
}
