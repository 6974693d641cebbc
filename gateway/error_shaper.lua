-- Portico's error shaper: runs on REST routes only (disabled per route for native gRPC, but for a call whose own
-- x-request-id it must cut: bound_request_id), and refuses a gRPC call on a REST path (refuse_grpc_call).
--
-- Every REST error leaves Envoy as {"error": {"message", "type", "param", "code"}} with content-type
-- application/json; on /v1/messages (and /v1/models asked with `anthropic-version`) the object also has a top-level
-- "type": "error" (the Anthropic SDK's shape), and so do the replies Envoy makes before it has read a path (see
-- shape_error).
-- Sources of errors, in the order handled below:
--   1. Envoy's own local replies (bad JSON, unknown URL, oversize body, upstream down or silent), marked by the
--      local_reply_config in envoy.yaml with a `portico-local-reply` header;
--   2. the server's contract: trailing metadata `portico-http-status` + `portico-error` (the exact body). When
--      the RPC fails before any message, gRPC sends "trailers-only" and they arrive as response headers; if the
--      server sent initial metadata first, they arrive as trailers (the transcoder holds the headers until then);
--   3. anything else from upstream (e.g. UNIMPLEMENTED): the transcoder's google.rpc.Status JSON, by HTTP status.
-- gRPC headers (grpc-*) and Portico's internal metadata (portico-*) never reach HTTP callers.

-- HTTP status -> code, type, message used when nobody supplied a better one, and the type in an Anthropic-shaped
-- body (/v1/messages: Anthropic's for the status). gateway/envoy.py replaces the next
-- line with the rows of server/errors.py (the one error table) when it renders Envoy's config.
local KINDS = {}  -- @KINDS@

-- A status without a row (none is expected: every status Envoy or Portico answers has one) keeps its class.
local function kind_of(status)
  return KINDS[status] or (status < 500 and KINDS[400]) or KINDS[500]
    or {"internal_error", "server_error", "The server had an error while processing your request.", "api_error"}
end

local ESCAPES = {['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t"}

-- The length of the valid UTF-8 sequence starting at byte i of s, or nil (no overlongs, surrogates or > U+10FFFF).
local function utf8_length(s, i)
  local c = s:byte(i)
  local n = (c < 0x80 and 1) or (c >= 0xC2 and c <= 0xDF and 2) or (c >= 0xE0 and c <= 0xEF and 3)
      or (c >= 0xF0 and c <= 0xF4 and 4)
  if not n then return nil end
  for j = i + 1, i + n - 1 do
    local b = s:byte(j)
    if not b or b < 0x80 or b > 0xBF then return nil end
  end
  local b = s:byte(i + 1)
  if (c == 0xE0 and b < 0xA0) or (c == 0xED and b > 0x9F) or (c == 0xF0 and b < 0x90) or (c == 0xF4 and b > 0x8F) then
    return nil
  end
  return n
end

-- s with each byte that starts no valid UTF-8 sequence as U+FFFD: a message may quote a query value the
-- transcoder decoded from %-escapes (`%ff`), and the body must stay valid JSON.
local function valid_utf8(s)
  if not s:find("[\128-\255]") then return s end
  local parts, i = {}, 1
  while i <= #s do
    local n = utf8_length(s, i)
    parts[#parts + 1] = n and s:sub(i, i + n - 1) or "\239\191\189"
    i = i + (n or 1)
  end
  return table.concat(parts)
end

local function json_string(s)
  if s == nil then return "null" end
  local escaped = valid_utf8(s):gsub('[%c"\\]', function(c) return ESCAPES[c] or string.format("\\u%04x", c:byte()) end)
  return '"' .. escaped .. '"'
end

-- A message is at most this many characters (server/errors.py's LONGEST_MESSAGE): one quoting a URL, which may be
-- as long as the 60 KiB of headers, is cut short, ending in an ellipsis.
local LONGEST_MESSAGE = 2000

local function message_string(text)
  if #text > LONGEST_MESSAGE then  -- bytes: a text that has no more fits in characters too
    local i = 1
    for _ = 1, LONGEST_MESSAGE - 1 do i = i + (utf8_length(text, i) or 1) end
    if i <= #text and i + (utf8_length(text, i) or 1) <= #text then text = text:sub(1, i - 1) .. "…" end
  end
  return json_string(text)
end

local function internal(key)
  return key:sub(1, 5) == "grpc-" or key:sub(1, 8) == "portico-"
end

local function strip_internal(map)
  local doomed = {}  -- collect first: removing while iterating is not allowed
  for key, _ in pairs(map) do
    if internal(key) then doomed[#doomed + 1] = key end
  end
  for _, key in ipairs(doomed) do map:remove(key) end
end

-- The trailers' own headers (e.g. retry-after, x-ratelimit-*) become response headers; the gRPC and portico-* ones
-- are dropped, so HTTP/2 callers get no trailers of the server's.
local function hoist(trailers, headers)
  for key, value in pairs(trailers) do
    if not internal(key) then headers:replace(key, value) end
  end
  strip_internal(trailers)
end

-- `message` is a JSON string literal (already quoted and escaped), or nil for the table's default.
local function error_body(status, message, param, anthropic)
  local kind = kind_of(status)
  local object = '{"message":' .. (message or json_string(kind[3])) .. ',"type":"' .. kind[anthropic and 4 or 2] ..
      '","param":' .. json_string(param) .. ',"code":"' .. kind[1] .. '"}'
  if anthropic then return '{"type":"error","error":' .. object .. "}" end
  return '{"error":' .. object .. "}"
end

-- A secret pasted into a URL (GET /v1/pk-.../chat) must not reach the access log, nor the 404's message: the path
-- remembered for both has anything shaped like a Portico secret cut out. Query strings are never kept.
local function redacted(path)
  if not path:find("pk-", 1, true) then return path end
  return (path:gsub("pk%-[%w_%-]+", "pk-[redacted]"))
end

-- A value the caller sent, quoted in a message: without a key pasted there, and cut short (a query value may be
-- as long as the 60 KiB of headers).
local function quoted_value(value)
  value = redacted(value)
  if #value > 100 then return value:sub(1, 100) .. "…" end
  return value
end

-- What a caller should have sent, for the protobuf type names in the transcoder's "invalid value" texts.
local EXPECTED = {TYPE_INT64 = "an integer", TYPE_INT32 = "an integer", TYPE_UINT64 = "a non-negative integer",
                  TYPE_UINT32 = "a non-negative integer", TYPE_DOUBLE = "a number", TYPE_FLOAT = "a number",
                  TYPE_BOOL = "true or false", TYPE_STRING = "a string"}
local INTEGER_RANGES = {TYPE_INT32 = "an integer from -2147483648 to 2147483647",
                        TYPE_INT64 = "an integer from -9223372036854775808 to 9223372036854775807",
                        TYPE_UINT32 = "an integer from 0 to 4294967295",
                        TYPE_UINT64 = "an integer from 0 to 18446744073709551615"}

-- The REST paths' templates as Lua patterns -> {the methods bound to them as an `allow` header, as a message says
-- them}. gateway/envoy.py replaces the next line with them, read from the descriptor set.
local ROUTE_METHODS = {}  -- @ROUTE_METHODS@

-- For "METHOD /path" that the transcoder refused as an unknown URL although the path is bound to other methods: the
-- `allow` header and the message naming them (`curl URL` without -d is a GET: "Unknown request URL" misled).
local function wrong_method(request)
  local method, path = request:match("^(%S+) (.*)$")
  for pattern, methods in pairs(ROUTE_METHODS) do
    if path and path:find(pattern) and not (", " .. methods[1] .. ","):find(", " .. method .. ",", 1, true) then
      return methods[1], method .. " is not a method of " .. path .. ": it takes " .. methods[2] .. "."
    end
  end
  return nil
end

-- Method -> the Lua patterns of its paths that take no body (every GET): gateway/envoy.py replaces the next line
-- with them, read from the descriptor set.
local BODILESS = {}  -- @BODILESS@

local function takes_no_body(method, path)
  for _, pattern in ipairs(BODILESS[method] or {}) do
    if path:find(pattern) then return true end
  end
  return false
end

-- Envoy's reply text -> message and param. The transcoder names the offending field first, e.g.
-- "messages[0].role: invalid value 1 for type TYPE_STRING" (a JSON body's field or a query parameter), which is
-- said in the caller's terms; JSON syntax errors carry a caret drawing. A query parameter refused by this filter
-- (refuse_parameter), or a request refused whole (refuse_request), comes with its own message.
local function describe_local_reply(status, text, request, query_param, fault)
  if fault then return message_string(fault), query_param end
  if status == 404 then
    local _, wrong = wrong_method(request)
    return message_string(wrong or ("Unknown request URL: " .. request .. ".")), nil
  end
  if status == 400 then
    local name, value, type_name = text:match("^([%w_%.%[%]]+): invalid value (.-) for type (TYPE_%u+%d*)")
    if name and EXPECTED[type_name] then
      -- A whole number refused for an integer field is out of the field's range: say which range.
      local expected = value:match('^"?%-?%d+"?$') and INTEGER_RANGES[type_name] or EXPECTED[type_name]
      local message = "Invalid value " .. quoted_value(value) .. " for " .. name .. ": expected " .. expected .. "."
      return json_string(message), name
    end
    local field = text:match("^([%w_%.%[%]]+): ")
    if field then return json_string((text:gsub("%s+$", ""))), field end
    -- The HTTP codec's own refusal of a request whose headers it had read (a broken chunked body): its text is the
    -- bare reason phrase, and no JSON was read at all.
    if text == "Bad Request" then return json_string("The request is malformed HTTP (its body's framing)."), nil end
    return json_string("Invalid JSON body: " .. text:match("^[^\n]*"):gsub("^:%s*", "")), nil
  end
  return nil, nil  -- the table's message: Envoy's wording ("upstream connect error ...") says too much
end

-- The "message" of a google.rpc.Status JSON body as a JSON string literal (the transcoder escaped it already).
local function status_message(json)
  local start = json:find('"message":"', 1, true)
  if not start then return nil end
  local i = start + 11
  local from = i
  while i <= #json do
    local c = json:sub(i, i)
    if c == "\\" then i = i + 2
    elseif c == '"' then return json:sub(from - 1, i)
    else i = i + 1 end
  end
  return nil
end

-- REST paths with a unary twin (the protos' *HttpUnary RPCs): a body that does not ask for a stream is answered
-- in one gRPC message, which costs grpc and Envoy less than a stream of one (docs/performance.md).
local UNARY_TWINS = {["/v1/chat/completions"] = "/v1/chat/completions:unary", ["/v1/messages"] = "/v1/messages:unary"}
local UNARY_PATHS = {}
for _, twin in pairs(UNARY_TWINS) do UNARY_PATHS[twin] = true end
-- Only bodies of a known length up to this are read for `stream`: reading one holds it in Lua, and a bigger or
-- chunked body keeps the streaming RPC, which answers either way.
local UNARY_SCAN_BYTES = 65536

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

local function unescape(text)
  return (text:gsub("%+", " "):gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

-- A query's `name=value` pair: its name (unescaped, without a trailing `[]`), whether it had `[]` (OpenAI's SDKs
-- write a list as `name[]=a&name[]=b`, brackets %-encoded or not), and the rest of the pair from its `=`.
local function query_pair(pair)
  local raw, rest = pair:match("^([^=]*)(.*)$")
  local name = unescape(raw)
  local list = name:match("^(.*)%[%]$")
  return list or name, list ~= nil, rest
end

-- The transcoder reads a list only as `name=a&name=b`, and skips names it does not know
-- (ignore_unknown_query_parameters: the anthropic SDK adds `?beta=true` elsewhere), so a filter or a grouping would be
-- dropped without a word and the answer would cover everything. Returns the query with list names made plain, or
-- nil, the parameter at fault and what is wrong.
local function organization_query(query, parameters)
  local rewritten, seen = {}, {}
  for pair in query:gmatch("[^&]+") do
    local name, list, rest = query_pair(pair)
    if parameters[name] == nil then
      local shown = quoted_value(name)  -- a name may be as long as the headers
      return nil, shown, "Unknown parameter " .. shown
    end
    local single = not parameters[name]
    if single and (list or seen[name]) then return nil, name, "Parameter " .. name .. " takes one value, not a list" end
    seen[name] = true
    rewritten[#rewritten + 1] = name .. rest
  end
  return table.concat(rewritten, "&")
end

-- The query parameters of the anthropic SDK's models route (envoy.yaml: AnthropicModelService), as above: `limit`,
-- `after_id`, `before_id`. gateway/envoy.py replaces the next line. Other names are left to the transcoder, which
-- skips them (the SDK's `?beta=true`).
local ANTHROPIC_MODELS_PARAMETERS = {}  -- @ANTHROPIC_MODELS_PARAMETERS@

-- The first one-value parameter of `parameters` given twice or as a list in `query`, or nil. The transcoder kept the
-- last of two values (after_id), or refused them in protobuf's words with no `param` (limit), and skipped `name[]`.
local function repeated_parameter(query, parameters)
  local seen = {}
  for pair in query:gmatch("[^&]+") do
    local name, list = query_pair(pair)
    if parameters[name] == false and (list or seen[name]) then return name end
    seen[name] = true
  end
  return nil
end

-- The names REST path templates bind ({id}, {model}, ...), by the template's fixed start ("/v1/admin/keys/"):
-- gateway/envoy.py replaces the next line with them, read from the descriptor set. The transcoder lets a query
-- parameter of that name replace the path's value, so that PATCH /v1/admin/keys/A?id=B changed key B: such a
-- parameter is refused on the paths under that start. Elsewhere it binds nothing and is ignored, as other ones are.
local PATH_VARIABLES = {}  -- @PATH_VARIABLES@

local function path_variable_in(path, query)
  for start, names in pairs(PATH_VARIABLES) do
    if path:sub(1, #start) == start then
      for pair in query:gmatch("[^&]+") do
        local name = query_pair(pair)
        if names[name] ~= nil then return name end
      end
    end
  end
  return nil
end

local function asks_for_stream(text)
  -- Any `"stream": true` member, at any depth: a nested one only costs the unary saving. A top-level key spelt
  -- with escapes is missed; the unary RPC then answers its events in one body.
  return text:find('"stream"%s*:%s*true') ~= nil
end

-- Marks a reply the server never saw (Envoy's own, or a worker that died), for Envoy's access log (envoy.yaml):
-- Portico's access log records every other request itself.
local function mark_envoy_reply(handle, status)
  handle:streamInfo():dynamicMetadata():set("portico", "envoy_reply", kind_of(status)[1])
end

-- A gRPC call on a REST path (envoy.yaml's route for them, whose `grpc: {}` match is Envoy's own test of the
-- content type, marks it in the route's metadata; native gRPC routes skip this filter): refused as gRPC's
-- "no such method", UNIMPLEMENTED. Envoy sends a local reply to a gRPC request as gRPC: HTTP 200, grpc-status from
-- the HTTP status (404: UNIMPLEMENTED) and grpc-message from the body; envoy_on_response restores the 404.
-- The route is a direct response, whose reply gets no virtual-host headers: request-id is set here.
local function refuse_grpc_call(handle, metadata, path)
  metadata:set("portico", "grpc_call", true)
  mark_envoy_reply(handle, 404)
  local id = handle:headers():get("x-request-id") or ""
  handle:respond({[":status"] = "404", ["request-id"] = id}, redacted(path) .. " is a REST path, not a gRPC " ..
    "method: call it as plain HTTP with JSON (content-type: application/json), or call the portico.v1 gRPC " ..
    "services instead.")
end

-- A key's value with a byte outside printable ASCII (a Latin-1 "é" from a browser, say) is no key Portico made.
-- grpc cannot decode such metadata and logs it whole (the secret with it), so it is refused here, before the
-- server: Envoy's local 401 becomes the table's invalid_api_key object in the caller's dialect (shape_error).
-- A tab between the scheme and the key (RFC 9110 allows only spaces there) is said to be one: the key may be right.
local function refuse_unreadable_key(handle, headers)
  for _, name in ipairs({"authorization", "x-api-key"}) do
    local value = headers:get(name)
    if value and value:find("[^\32-\126]") then
      if name == "authorization" and value:find("^[^ \t]+[ \t]*\t") then
        handle:streamInfo():dynamicMetadata():set("portico", "fault", "Malformed Authorization header: a tab " ..
          "separates its scheme from the key, where HTTP allows only spaces. Send it as " ..
          "`Authorization: Bearer YOUR_KEY`.")
      end
      handle:respond({[":status"] = "401"}, "")
      return true
    end
  end
  return false
end

-- A 400 for the request as a whole, no `param` (shape_error). The message goes in the metadata too: Envoy sends a
-- local reply to HEAD without its body, and answer_head must still give the GET's content-length.
local function refuse_request(handle, metadata, message)
  metadata:set("portico", "fault", message)
  handle:respond({[":status"] = "400"}, message)
end

-- The same, naming the query parameter `name` as `param`.
local function refuse_parameter(handle, metadata, name, message)
  -- The name is the caller's, quoted in both: a key pasted there is cut out, as from a path.
  metadata:set("portico", "query_param", redacted(name))
  refuse_request(handle, metadata, redacted(message))
end

-- The buffer filter's cap on request bodies (envoy.yaml; gateway/envoy.py fills it in; 0: none). A body announced
-- larger is refused on its headers, as it would be once that much had been read: a client that sends no body after
-- such a content-length got no answer at all, Envoy waiting for bytes that never came.
local MAX_BODY_BYTES = 0  -- @MAX_BODY_BYTES@

-- Whether `s` is UTF-8 text (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
local function is_utf8(s)
  if not s:find("[\128-\255]") then return true end
  local i, n = 1, #s
  while i <= n do
    local c = s:byte(i)
    local size, low, high = 1, 0x80, 0xBF  -- the bytes after the first, and the second's range
    if c < 0x80 then size = 1
    elseif c >= 0xC2 and c <= 0xDF then size = 2
    elseif c == 0xE0 then size, low = 3, 0xA0
    elseif c == 0xED then size, high = 3, 0x9F
    elseif c >= 0xE1 and c <= 0xEF then size = 3
    elseif c == 0xF0 then size, low = 4, 0x90
    elseif c >= 0xF1 and c <= 0xF3 then size = 4
    elseif c == 0xF4 then size, high = 4, 0x8F
    else return false end
    for k = 1, size - 1 do
      local b = s:byte(i + k)
      if not b or b < (k == 1 and low or 0x80) or b > (k == 1 and high or 0xBF) then return false end
    end
    i = i + size
  end
  return true
end

-- A caller may choose its request id, which every log keeps: a key pasted there is cut out, and an id is cut to
-- 128 bytes (never inside a character), here, so that the id the caller gets back is the one logged. An id that
-- is not UTF-8 text (HTTP allows any byte above 0x7f) cannot be logged as sent: it is removed, and the virtual
-- host gives the request a new one (envoy.yaml), as Envoy does a request without one.
local function bound_request_id(headers)
  local id = headers:get("x-request-id")
  if not id then return end
  if not is_utf8(id) then
    headers:remove("x-request-id")
  elseif #id > 128 or id:find("pk-", 1, true) then
    id = redacted(id)
    local n = math.min(#id, 128)
    while n > 0 and (id:byte(n + 1) or 0) >= 0x80 and id:byte(n + 1) < 0xC0 do n = n - 1 end  -- a continuation
    headers:replace("x-request-id", id:sub(1, n))
  end
end

function envoy_on_request(handle)
  -- The response side cannot see the request: remember "METHOD /path" for the error shaping. The mark also tells
  -- local_reply_config in envoy.yaml that this is a REST request (the transcoder rewrites content-type and path).
  local headers = handle:headers()
  -- A native gRPC call reaches this filter only to have its id cut (envoy.yaml): nothing else here is for it.
  -- Asked and remembered before the cut, which sends the call to its route again, maybe to one without this mark.
  if handle:metadata():get("native_grpc") then
    handle:streamInfo():dynamicMetadata():set("portico", "native_grpc", true)
    return bound_request_id(headers)
  end
  bound_request_id(headers)
  local full_path = headers:get(":path") or ""
  local path = full_path:match("^[^?]*")
  local method = headers:get(":method") or ""
  local metadata = handle:streamInfo():dynamicMetadata()
  -- CONNECT (a caller taking the gateway for its proxy: curl -x) names a host, not a path, and opens a tunnel whose
  -- body never ends: the buffer filter waited for it until Envoy's timeouts. Nothing here is a proxy: 404 at once
  -- (no route matches a request without a path, so the virtual host's request-id is set here).
  if method == "CONNECT" then
    metadata:set("portico", "request", "CONNECT " .. redacted(headers:get(":authority") or ""))
    return handle:respond({[":status"] = "404", ["request-id"] = headers:get("x-request-id") or ""}, "")
  end
  metadata:set("portico", "request", method .. " " .. redacted(path))
  -- The anthropic SDK's models route (envoy.yaml) says so in its metadata: remembered for the error's shape now,
  -- before any refusal below, and since the transcoder re-routes the call (its path becomes the RPC's).
  local anthropic = path:sub(1, 10) == "/v1/models" and handle:metadata():get("anthropic")
  if anthropic then metadata:set("portico", "anthropic", true) end
  -- The transcoder reads a last segment's ":unary" as the unary twins' custom verb, so GET /v1/models/x:unary (a
  -- model id ending so, as the SDKs send it) matched no route. Escaped, the colon is part of the id.
  if path:sub(1, 11) == "/v1/models/" and path:sub(-6) == ":unary" then
    headers:replace(":path", path:sub(1, -7) .. "%3Aunary" .. full_path:sub(#path + 1))
  end
  if handle:metadata():get("grpc_call") then return refuse_grpc_call(handle, metadata, path) end
  if refuse_unreadable_key(handle, headers) then return end
  local length = tonumber(headers:get("content-length") or "")
  if length and MAX_BODY_BYTES > 0 and length > MAX_BODY_BYTES then
    return handle:respond({[":status"] = "413"}, "")
  end
  -- A compressed body was read as JSON text ("str is not valid UTF-8"), which says nothing of the cause.
  local encoding = headers:get("content-encoding")
  if encoding and encoding:lower() ~= "identity" and method ~= "GET" and method ~= "HEAD" then
    return refuse_request(handle, metadata, "Compressed request bodies are not supported (Content-Encoding: " ..
      redacted(encoding):gsub("[^%w%-,; %[%]]", "?"):sub(1, 40) .. "): send the JSON uncompressed.")
  end
  -- HEAD is GET without the body (monitors and load balancers probe /healthz, /readyz, /console with it): the
  -- transcoder binds GET only, so it goes on as GET, checked as GET here, and answer_head drops the body.
  local head = method == "HEAD"
  if head then
    headers:replace(":method", "GET")
    metadata:set("portico", "head", true)
    method = "GET"
  end
  -- The transcoder read the body of a route that takes none as its request message: fields the query's checks
  -- below never saw (GET /v1/organization/costs with {"start_time": 1}), or over the URL's own (POST
  -- /v1/admin/keys/A/revoke with {"id": "B"} revoked B); else "Invalid JSON body" for a body of no meaning.
  if takes_no_body(method, path) then
    local body = handle:body()  -- nil at once for a request that has none
    -- An empty object is no parameter: SDKs and the console send `{}` with a POST that has none.
    if body and body:length() > 0 and not (body:length() <= 64 and
        body:getBytes(0, body:length()):match("^%s*{%s*}%s*$")) then
      return refuse_request(handle, handle:streamInfo():dynamicMetadata(), method .. " " .. redacted(path) ..
        " takes no body: its parameters go in the URL.")
    end
    headers, metadata = handle:headers(), handle:streamInfo():dynamicMetadata()  -- body() yielded
  end
  if full_path ~= path then  -- a query string; shape_error names the parameter refused here as `param`
    local query = full_path:sub(#path + 2)
    local parameters = ORGANIZATION_PARAMETERS[path]
    if parameters and method == "GET" then
      local rewritten, param, fault = organization_query(query, parameters)
      if rewritten == nil then
        return refuse_parameter(handle, metadata, param, fault .. " for GET " .. path .. ": it takes " ..
          ORGANIZATION_NAMES[path] .. ".")
      end
      return headers:replace(":path", path .. "?" .. rewritten)
    end
    local single = anthropic and ANTHROPIC_MODELS_PARAMETERS[path]
    local repeated = single and method == "GET" and repeated_parameter(query, single)
    if repeated then
      return refuse_parameter(handle, metadata, repeated, "Parameter " .. repeated .. " takes one value, not a " ..
        "list, for GET " .. path .. ".")
    end
    local name = path_variable_in(path, query)
    if name then
      return refuse_parameter(handle, metadata, name, "Parameter " .. name .. " belongs in the URL's path, not " ..
        "its query: " .. redacted(path) .. " names what it acts on.")
    end
  end
  -- An image link's answer is one message, which the transcoder streams (chunked): read whole on the way back, it
  -- gets a content-length, the one its HEAD gives.
  if path:sub(1, 19) == "/v1/images/content/" then metadata:set("portico", "whole", true) end
  if head then return end
  if UNARY_PATHS[path] then return metadata:set("portico", "unary", true) end
  local twin = UNARY_TWINS[path]
  if twin == nil or method ~= "POST" or length == nil or length == 0 or length > UNARY_SCAN_BYTES then return end
  local body = handle:body()
  if body == nil or asks_for_stream(body:getBytes(0, body:length())) then return end
  -- Headers re-fetched: body() yielded. The route stays the same (/v1/); the transcoder maps the new path.
  handle:headers():replace(":path", twin .. (full_path:match("%?.*") or ""))
  handle:streamInfo():dynamicMetadata():set("portico", "unary", true)
end

local function replace_body(buffer, headers, body)
  buffer:setBytes(body)
  headers:replace("content-type", "application/json")
  headers:replace("content-length", tostring(#body))
end

-- Envoy's codec refuses some requests before any filter sees them: malformed HTTP with a 400 that said only "The
-- request is invalid.", and others with statuses that blame the wrong side: a
-- connection upgrade (WebSocket: an OpenAI Realtime client, say) with a 403, read as `permission_denied`, the key;
-- a transfer coding it cannot read (gzip, anything but chunked) with a 501, a server fault. The request is wrong: 400
-- (a 404 stays one).
local CODEC_REFUSALS = {
  [400] = "The request is not well-formed HTTP/1.1 (its request line, a header, or the body's framing: " ..
    "Content-Length and Transfer-Encoding together, say).",
  [403] = "Connection upgrades (WebSocket) are not supported: send plain HTTP/1.1 or HTTP/2 requests.",
  -- A target that is not a path (`OPTIONS *`): the codec's 404 said only "Not found.".
  [404] = "Unknown request URL: the request's target is not a path (such as /v1/models).",
  [501] = "This Transfer-Encoding is not supported: send the body with a Content-Length or with " ..
    "Transfer-Encoding: chunked alone.",
}

local function shape_error(handle, status)
  local portico = handle:streamInfo():dynamicMetadata():get("portico") or {}
  local request = portico.request
  local path = request and request:match(" (.*)") or ""
  -- A HEAD gets its GET's headers (answer_head): the message names GET too, or content-length would be the HEAD's.
  if portico.head then request = "GET " .. path end
  -- No request: Envoy's HTTP codec answered before any filter saw one (HTTP/1.0, headers over the limit or too slow,
  -- a malformed request), so the path is unknown. Such a reply takes the Anthropic shape wherever it was sent: it is
  -- then right on /v1/messages, and OpenAI clients read it as well (they look at "error" only).
  local anthropic = request == nil or path == "/v1/messages" or path == UNARY_TWINS["/v1/messages"]
    or path:sub(1, 13) == "/v1/messages/" or portico.anthropic
  local buffer = handle:body(true)  -- true: an empty buffer (not nil) when the reply has no body
  local body = buffer:getBytes(0, buffer:length())
  local trailers = handle:trailers()
  local headers = handle:headers()  -- fetched after body(): objects from before a yield are invalidated
  local refusal = request == nil and CODEC_REFUSALS[status]
  if refusal then
    local refused = status == 404 and 404 or 400
    headers:replace(":status", tostring(refused))
    mark_envoy_reply(handle, refused)
    return replace_body(buffer, headers, error_body(refused, json_string(refusal), nil, anthropic))
  end
  if headers:get("portico-local-reply") then
    mark_envoy_reply(handle, status)
    local allow = status == 404 and request and wrong_method(request)
    if allow then headers:replace("allow", allow) end
    local message, param = describe_local_reply(status, body, request, portico.query_param, portico.fault)
    return replace_body(buffer, headers, error_body(status, message, param, anthropic))
  end
  local shaped, http_status = headers:get("portico-error"), headers:get("portico-http-status")
  if not shaped then
    -- Failed after initial metadata: the transcoder held the headers, the contract is in the trailers.
    if trailers then
      shaped, http_status = trailers:get("portico-error"), trailers:get("portico-http-status")
      hoist(trailers, headers)
    end
  end
  if shaped then
    if http_status then headers:replace(":status", http_status) end
    return replace_body(buffer, headers, shaped)
  end
  -- Not Portico's contract (e.g. UNIMPLEMENTED, or grpc's own limits): shape the Status JSON by HTTP status.
  if status == 499 then
    -- CANCELLED that the server did not send as Portico's contract: grpc-core dropped the call unanswered (too
    -- many queued). The caller is still here to read this, so it is an overload worth retrying, not a 499.
    status = 503
    headers:replace(":status", "503")
    headers:replace("retry-after", "1")
    body = ""
  end
  mark_envoy_reply(handle, status)
  replace_body(buffer, headers, error_body(status, status_message(body), nil, anthropic))
end

-- A unary twin's answer sends its headers (x-ratelimit-*) as trailing metadata, in the gRPC batch that ends the
-- call, rather than in an initial-metadata batch of their own (a round trip through grpc-core: ~0.05 ms of the
-- server's CPU per request). The transcoder holds a unary answer's headers until its trailers anyway, so they are
-- moved up here before anything reaches the caller.
local function hoist_trailers(handle)
  handle:body()  -- the whole answer, already held by the transcoder: waiting for it keeps the headers here
  local trailers = handle:trailers()
  if trailers then hoist(trailers, handle:headers()) end
end

-- The gRPC answer Envoy made of refuse_grpc_call's 404: its grpc-* headers are the answer, so only portico-* goes.
-- The HTTP status goes back to 404, so that the failure is no 200 to a caller that reads only that (curl). gRPC
-- clients get UNIMPLEMENTED either way: from grpc-status (grpc-core's, Python's among them, with grpc-message), or
-- from the 404 itself for those that go by a non-200 status before grpc-status (grpc-go, with its own message).
local function answer_grpc_call(handle)
  local headers = handle:headers()
  headers:replace(":status", "404")
  headers:remove("portico-local-reply")
end

-- The answer to a HEAD request, which went on as GET: GET's status and headers (content-length included), no body.
-- Envoy would send the body otherwise, which breaks a kept-alive HTTP/1.1 connection and is an HTTP/2 error.
local function answer_head(handle, status, whole)
  if status >= 400 then shape_error(handle, status) end
  local buffer = handle:body(true)
  local trailers = handle:trailers()
  if trailers then strip_internal(trailers) end
  local headers = handle:headers()  -- fetched after body(): objects from before a yield are invalidated
  local length = headers:get("content-length") or (whole and status < 400 and buffer:length())
  buffer:setBytes("")
  if length then headers:replace("content-length", tostring(length)) end
  strip_internal(headers)
end

function envoy_on_response(handle)
  local portico = handle:streamInfo():dynamicMetadata():get("portico") or {}
  if portico.native_grpc then return end
  local status = tonumber(handle:headers():get(":status")) or 500
  if portico.grpc_call and status < 400 then return answer_grpc_call(handle) end
  if portico.head then return answer_head(handle, status, portico.whole) end
  local unary = status < 400 and portico.unary
  if status >= 400 then
    shape_error(handle, status)
  elseif unary then
    hoist_trailers(handle)
  elseif portico.whole then
    hoist_trailers(handle)
    handle:headers():replace("content-length", tostring(handle:body():length()))
  end
  strip_internal(handle:headers())
  -- HTTP/2 callers would also receive the gRPC trailers (grpc-status, grpc-message). Iterating the chunks does
  -- not buffer the stream, so SSE still flows message by message. HTTP/1.1 drops trailers anyway. (Errors and
  -- unary answers were read whole above: bodyChunks() is not for them.)
  if status < 400 and not unary and not portico.whole and handle:streamInfo():protocol() == "HTTP/2" then
    for _ in handle:bodyChunks() do end
    local trailers = handle:trailers()
    if trailers then strip_internal(trailers) end
  end
end
