-- Portico's error shaper: runs on REST routes only (disabled per route for native gRPC, but for a call whose own
-- x-request-id it must cut: bound_request_id), and refuses a gRPC call on a REST path (refuse_grpc_call).
--
-- Every REST error leaves Envoy as {"error": {"message", "type", "param", "code"}} with content-type
-- application/json; on /v1/messages (and /v1/models, or a path nothing serves, asked with `anthropic-version`) the
-- object also has a top-level "type": "error" (the Anthropic SDK's shape), and so do the replies Envoy makes before
-- it has read a path (see shape_error).
-- Sources of errors, in the order shape_error (response.lua) handles them:
--   1. Envoy's own local replies (bad JSON, unknown URL, oversize body, upstream down or silent), marked by the
--      local_reply_config in envoy.yaml with a `portico-local-reply` header;
--   2. the server's contract: trailing metadata `portico-http-status` + `portico-error` (the exact body). When
--      the RPC fails before any message, gRPC sends "trailers-only" and they arrive as response headers; if the
--      server sent initial metadata first, they arrive as trailers (the transcoder holds the headers until then);
--   3. anything else from upstream (e.g. UNIMPLEMENTED): the transcoder's google.rpc.Status JSON, by HTTP status.
-- gRPC headers (grpc-*) and Portico's internal metadata (portico-*) never reach HTTP callers.
--
-- gateway/envoy.py joins this directory's parts into the one script Envoy runs, in its LUA_PARTS order: a Lua
-- `local` is seen only by the code after it, so each part comes after those whose locals it uses. This one holds
-- the tables gateway/envoy.py fills in (each placeholder line replaced whole) when it renders Envoy's config.

-- HTTP status -> code, type, message used when nobody supplied a better one, and the type in an Anthropic-shaped
-- body (/v1/messages: Anthropic's for the status). gateway/envoy.py replaces the next
-- line with the rows of server/errors.py (the one error table) when it renders Envoy's config.
local KINDS = {}  -- @KINDS@

-- The REST paths' templates as Lua patterns -> {the methods bound to them as an `allow` header, as a message says
-- them}. gateway/envoy.py replaces the next line with them, read from the descriptor set.
local ROUTE_METHODS = {}  -- @ROUTE_METHODS@

-- Method -> the Lua patterns of its paths that take no body (every GET): gateway/envoy.py replaces the next line
-- with them, read from the descriptor set.
local BODILESS = {}  -- @BODILESS@

-- The query parameters of the GET paths under /v1/organization/ (OpenAI's usage and costs API): name -> true for a
-- list, false for one value. gateway/envoy.py replaces the next line with the request messages' fields, read from the
-- descriptor set the transcoder maps them with (gateway/query_parameters.py).
local ORGANIZATION_PARAMETERS = {}  -- @ORGANIZATION_PARAMETERS@
local ORGANIZATION_NAMES = {}  -- path -> its parameters' names, sorted, for the refusal's message
for path, parameters in pairs(ORGANIZATION_PARAMETERS) do
  local names = {}
  for name, _ in pairs(parameters) do names[#names + 1] = name end
  table.sort(names)
  ORGANIZATION_NAMES[path] = table.concat(names, ", ")
end

-- The query parameters of the anthropic SDK's models route (envoy.yaml: AnthropicModelService), as above: `limit`,
-- `after_id`, `before_id`, the list `lifecycle`. gateway/envoy.py replaces the next line. Other names are left to the
-- transcoder, which skips them (the SDK's `?beta=true`).
local ANTHROPIC_MODELS_PARAMETERS = {}  -- @ANTHROPIC_MODELS_PARAMETERS@

-- The query parameters of the GET paths under /v1/admin/ that take some (ListKeys' `page_size`, `page_token`), as
-- above; gateway/envoy.py replaces the next line. Other names are skipped by the transcoder.
local ADMIN_PARAMETERS = {}  -- @ADMIN_PARAMETERS@

-- The whole-number query parameters of those routes with a range, and the server's message for a value out of it:
-- route -> parameter -> {low, high, message (a format taking the value as sent)}, or, where another parameter's value
-- picks the range, {by = that parameter, [its value] = {low, high, message}} ("": it is absent or empty).
-- gateway/envoy.py replaces the next line from the server's own constants and messages (query_ranges).
local QUERY_RANGES = {}  -- @QUERY_RANGES@

-- The names REST path templates bind ({id}, {model}, ...), by the template's fixed start ("/v1/admin/keys/"):
-- gateway/envoy.py replaces the next line with them, read from the descriptor set. The transcoder lets a query
-- parameter of that name replace the path's value, so that PATCH /v1/admin/keys/A?id=B changed key B: such a
-- parameter is refused on the paths under that start. Elsewhere it binds nothing and is ignored, as other ones are.
local PATH_VARIABLES = {}  -- @PATH_VARIABLES@

-- The buffer filter's cap on request bodies (envoy.yaml; gateway/envoy.py fills it in; 0: none). A body announced
-- larger is refused on its headers, as it would be once that much had been read: a client that sends no body after
-- such a content-length got no answer at all, Envoy waiting for bytes that never came.
local MAX_BODY_BYTES = 0  -- @MAX_BODY_BYTES@
