-- The request side: refusals made before the server sees a request, the request id's bounds, the unary
-- twins, and Envoy's entry point envoy_on_request.

local function takes_no_body(method, path)
  for _, pattern in ipairs(BODILESS[method] or {}) do
    if path:find(pattern) then return true end
  end
  return false
end

-- REST paths with a unary twin (the protos' *HttpUnary RPCs): a body that does not ask for a stream is answered
-- in one gRPC message, which costs grpc and Envoy less than a stream of one (docs/performance.md).
local UNARY_TWINS = {["/v1/chat/completions"] = "/v1/chat/completions:unary", ["/v1/messages"] = "/v1/messages:unary"}
local UNARY_PATHS = {}
for _, twin in pairs(UNARY_TWINS) do UNARY_PATHS[twin] = true end
-- Only bodies of a known length up to this are read for `stream`: reading one holds it in Lua, and a bigger or
-- chunked body keeps the streaming RPC, which answers either way.
local UNARY_SCAN_BYTES = 65536

local function asks_for_stream(text)
  -- Any `"stream": true` member, at any depth: a nested one only costs the unary saving. A top-level key spelt
  -- with escapes is missed; the unary RPC then answers its events in one body.
  return text:find('"stream"%s*:%s*true') ~= nil
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

-- What a caller may paste around a key that HTTP takes for no space (RFC 9110 allows spaces and tabs around a
-- field's value, and only spaces between a scheme and its token): Lua patterns of its bytes (UTF-8, and Latin-1's
-- non-breaking space last, after the UTF-8 characters that end in the same byte), and its name for the message.
local ODD_SPACES = {
  {"\t", "a tab"}, {"\194\160", "a non-breaking space"}, {"\226\128\175", "a non-breaking space"},
  {"\226\128\139", "a zero-width space"}, {"\239\187\191", "a zero-width space"},
  {"\226\128[\128-\138]", "a Unicode space"}, {"\226\129\159", "a Unicode space"},
  {"\227\128\128", "a Unicode space"}, {"\160", "a non-breaking space"},
}

-- The message for a key header whose value is a key's form (Authorization: scheme, spaces, key; x-api-key: the key
-- alone) but for such a space beside a key that may well be right; nil for anything else, no key Portico made.
local function misplaced_space(name, value)
  local first, what
  for _, odd in ipairs(ODD_SPACES) do
    local at = value:find(odd[1])
    if at and (first == nil or at < first) then first, what = at, odd[2] end
  end
  local plain = value
  for _, odd in ipairs(ODD_SPACES) do plain = plain:gsub(odd[1], " ") end
  if first == nil or plain:find("[^\32-\126]") then return nil end
  local words = {}  -- where each run of visible ASCII (the scheme, the key) starts and ends
  for start, stop in value:gmatch("()[!-~]+()") do words[#words + 1] = {start, stop} end
  local authorization = name == "authorization"
  if #words ~= (authorization and 2 or 1) then return nil end
  local header, form = "x-api-key", "`x-api-key: YOUR_KEY`"
  if authorization then header, form = "Authorization", "`Authorization: Bearer YOUR_KEY`" end
  local where
  if first < words[1][1] then
    where = " comes before " .. (authorization and "its scheme" or "the key") .. "."
  elseif first >= words[#words][2] then
    where = " follows the key."
  else
    where = " separates its scheme from the key, where HTTP allows only spaces."
  end
  return "Malformed " .. header .. " header: " .. what .. where .. " Send it as " .. form .. "."
end

-- A refusal made from the headers alone waits for the body first (the buffer filter would hold it anyway), unless
-- it is announced over the cap: answered before the request has ended, it cost an HTTP/1.1 caller its connection
-- (`connection: close`), and over HTTP/2 it was followed by a reset of the stream, which curl reports as an error
-- in place of the answer.
local function await_body(handle)
  local length = tonumber(handle:headers():get("content-length") or "")
  if length == nil or length <= MAX_BODY_BYTES then handle:body() end
end

-- A key's value with a byte outside printable ASCII (a Latin-1 "é" from a browser, say) is no key Portico made.
-- grpc cannot decode such metadata and logs it whole (the secret with it), so it is refused here, before the
-- server: Envoy's local 401 becomes the table's invalid_api_key object in the caller's dialect (shape_error).
-- A tab or a pasted space beside the key is said to be one (misplaced_space): the key may be right. x-api-key is
-- read only on /v1/messages and /v1/models: elsewhere it is removed unread, not refused (the request's key is in
-- Authorization), and never reaches grpc; so is either one on a path that takes no key.
local function refuse_unreadable_key(handle, headers, path)
  -- /healthz, /readyz, the console's files and image links take no key: theirs is not read either.
  local reads_key = path:sub(1, 4) == "/v1/" and path:sub(1, 19) ~= "/v1/images/content/"
  local reads_x_api_key = reads_key and (path:sub(1, 12) == "/v1/messages" or path:sub(1, 10) == "/v1/models")
  for _, name in ipairs({"authorization", "x-api-key"}) do
    local value = headers:get(name)
    if value and value:find("[^\32-\126]") then
      if not reads_key or (name == "x-api-key" and not reads_x_api_key) then
        headers:remove(name)
      else
        local fault = misplaced_space(name, value)
        await_body(handle)
        if fault then handle:streamInfo():dynamicMetadata():set("portico", "fault", fault) end
        handle:respond({[":status"] = "401"}, "")
        return true
      end
    end
  end
  return false
end

-- Content-Encoding is a list of codings (two fields of it arrive joined by a comma): an empty one, or one naming
-- only `identity`, says the body is as sent, and was refused as "Compressed ... (Content-Encoding: )".
local function names_a_coding(encoding)
  for coding in encoding:gmatch("[^,]+") do
    local name = coding:match("^%s*(.-)%s*$"):lower()
    if name ~= "" and name ~= "identity" then return true end
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

-- A caller may choose its request id, which every log keeps: a key pasted there is cut out, and an id is cut to
-- 128 bytes (never inside a character), here, so that the id the caller gets back is the one logged. An id that
-- is not UTF-8 text (HTTP allows any byte above 0x7f) cannot be logged as sent: it is removed, and the virtual
-- host gives the request a new one (envoy.yaml), as Envoy does a request without one. So is one holding a C1
-- control (U+0080-U+009F: NEL splits a line for many readers, CSI starts a terminal's escape), a line or paragraph
-- separator (U+2028, U+2029) or a direction control (U+202A-U+202E, U+2066-U+2069), which reorders the line.
local function loggable(id)
  return is_utf8(id) and not (id:find("\194[\128-\159]") or id:find("\226\128[\168-\174]")
    or id:find("\226\129[\166-\169]"))
end

local function bound_request_id(headers)
  local id = headers:get("x-request-id")
  if not id then return end
  if not loggable(id) then
    headers:remove("x-request-id")
  elseif #id > 128 or id:find("pk-", 1, true) then
    id = redacted_as_sent(id)
    local n = math.min(#id, 128)
    while n > 0 and (id:byte(n + 1) or 0) >= 0x80 and id:byte(n + 1) < 0xC0 do n = n - 1 end  -- a continuation
    headers:replace("x-request-id", id:sub(1, n))
  end
end

-- The transcoded call carries a REST caller's headers on to grpc as metadata, and grpc reads its own (`grpc-*`) and
-- decodes binary ones (`*-bin`, base64) before the server sees the call: from a REST caller they are no part of its
-- request, yet one grpc could not parse was a 500 (`x-trace-bin: ...`), and `grpc-timeout` set the call's deadline
-- (a 504 blaming an upstream). So was a name HTTP allows and gRPC does not (`x!note`: "Illegal header key"): none is
-- Portico's. Removed after the walk: headers cannot change while it runs.
local function drop_grpc_headers(headers)
  local names = {}
  for name, _ in pairs(headers) do
    if name:sub(1, 5) == "grpc-" or name:sub(-4) == "-bin" or
        (name:find("[^a-z0-9_.%-]") and name:sub(1, 1) ~= ":") then  -- not a pseudo-header (:path)
      names[#names + 1] = name
    end
  end
  for _, name in ipairs(names) do headers:remove(name) end
end

-- The trace id of a caller's W3C traceparent, for Envoy's access-log line of a reply the server never saw (the
-- server logs its own): read as the server's OpenTelemetry propagator reads it (lowercase hex, no all-zero ids,
-- version ff refused, version 00 exactly as long as the spec says, a later one perhaps longer), else nil.
local HEX = "[0-9a-f]"
local TRACEPARENT = "^[ \t]*(" .. HEX:rep(2) .. ")%-(" .. HEX:rep(32) .. ")%-(" .. HEX:rep(16) .. ")%-" .. HEX:rep(2)
  .. "(.*)$"

local function caller_trace_id(traceparent)
  if not traceparent or #traceparent > 512 then return nil end
  local version, trace, span, rest = traceparent:match(TRACEPARENT)
  if not version or version == "ff" or trace == ("0"):rep(32) or span == ("0"):rep(16) then return nil end
  if rest:find("^[ \t]*$") or (version ~= "00" and rest:sub(1, 1) == "-") then return trace end
  return nil
end

-- Whether a native gRPC request's body ends inside a message: its 5-byte prefix (a flag, then the length) cut, or
-- fewer bytes after it than the length says. grpc (the server's C core) waits for the rest of such a message even
-- though the stream has ended, and never calls the method: the caller heard nothing until Envoy's silence limit.
local function after_message(at, b1, b2, b3, b4)  -- the message at `at`, whose length bytes are b1..b4: its end
  return at + 5 + ((b1 * 256 + b2) * 256 + b3) * 256 + b4
end

local function ends_inside_a_message(body)
  local length = body:length()
  if length < 5 then return true end
  local at = after_message(0, body:getBytes(1, 4):byte(1, 4))
  if at >= length then return at > length end  -- one message, as every unary method takes
  -- More (grpc passes them on): read from one copy of the body. A getBytes per message took Envoy's worker thread 2 s
  -- for a 16 MiB body of empty ones.
  local bytes = body:getBytes(0, length)
  while at < length do
    if length - at < 5 then return true end
    at = after_message(at, bytes:byte(at + 2, at + 5))
  end
  return at > length
end

-- Such a call is answered as gRPC servers answer it (grpc-java: "Encountered end-of-stream mid-frame"): INTERNAL,
-- at once. Envoy sends a gRPC caller's local 400 as grpc-status 13 with the body as grpc-message (trailers-only).
-- Reading the body holds the call until it has all arrived: a portico.v1 request is one message (no method takes
-- a stream of them), which grpc does not read before it has all arrived either.
-- So is one that ended before any message (grpc-java: "Half-closed without a request"), which grpc left
-- unanswered too.
local function refuse_cut_message(handle)
  local body = handle:body()  -- nil at once for a request whose headers ended it
  if body == nil or body:length() == 0 then
    mark_envoy_reply(handle, 400)
    return handle:respond({[":status"] = "400"}, "The request ended before its gRPC message: the method takes " ..
      "one request message.")
  end
  if not ends_inside_a_message(body) then return end
  mark_envoy_reply(handle, 400)
  handle:respond({[":status"] = "400"}, "The request ended inside a gRPC message: its stream closed before the " ..
    "message's 5-byte prefix, or all the bytes the prefix announced, had arrived.")
end

function envoy_on_request(handle)
  -- The response side cannot see the request: remember "METHOD /path" for the error shaping. The mark also tells
  -- local_reply_config in envoy.yaml that this is a REST request (the transcoder rewrites content-type and path).
  local headers = handle:headers()
  local trace_id = caller_trace_id(headers:get("traceparent"))
  if trace_id then handle:streamInfo():dynamicMetadata():set("portico", "trace_id", trace_id) end
  -- A native gRPC call reaches this filter to have its id cut and, for unary methods, its framing read
  -- (envoy.yaml): nothing else here is for it. Asked and remembered before the cut, which sends the call to its
  -- route again, maybe to one without this mark.
  if handle:metadata():get("native_grpc") then
    -- A unary call's mark is its path, which the access-log line of a reply Envoy makes to it names.
    local path = headers:get(":path") or ""
    local unary = path:sub(1, 12) == "/portico.v1." or path == "/grpc.health.v1.Health/Check" or
      path == "/grpc.health.v1.Health/List"
    handle:streamInfo():dynamicMetadata():set("portico", "native_grpc", unary and path or true)
    bound_request_id(headers)
    if unary then return refuse_cut_message(handle) end
    return
  end
  bound_request_id(headers)
  drop_grpc_headers(headers)
  -- The transcoder copies content-type into google.api.HttpBody's content_type, a protobuf string: one holding a
  -- byte that is not UTF-8 failed to decode in the server, a 400 naming that field. A REST body is JSON whatever its
  -- label says, and no media type is anything but ASCII: such a label is dropped.
  local content_type = headers:get("content-type")
  if content_type and content_type:find("[\128-\255]") then headers:remove("content-type") end
  local full_path = headers:get(":path") or ""
  local path = full_path:match("^[^?]*")
  -- The transcoder serves a path with trailing `/`s as the path without them (`GET /v1/organization/costs/`, and
  -- `costs//`): the tables of paths below are looked up without them too, or such a request skipped the query's
  -- checks (a parameter given twice got protobuf's "oneof field ... is already set", an unknown one was dropped).
  local route = path:match("^(/.-)/*$") or path
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
  -- So does a path nothing serves asked with `anthropic-version` (the SDK's files, skills, ...): its 404 reaches
  -- an anthropic SDK caller, whom OpenAI's shape would not suit (the openai SDK never sends that header).
    or (headers:get("anthropic-version") and not served_path(path))
  if anthropic then metadata:set("portico", "anthropic", true) end
  -- The transcoder reads a last segment's ":unary" as the unary twins' custom verb, so GET /v1/models/x:unary (a
  -- model id ending so, as the SDKs send it) matched no route. Escaped, the colon is part of the id.
  if path:sub(1, 11) == "/v1/models/" and path:sub(-6) == ":unary" then
    headers:replace(":path", path:sub(1, -7) .. "%3Aunary" .. full_path:sub(#path + 1))
  end
  if handle:metadata():get("grpc_call") then return refuse_grpc_call(handle, metadata, path) end
  if refuse_unreadable_key(handle, headers, path) then return end
  local length = tonumber(headers:get("content-length") or "")
  if length and MAX_BODY_BYTES > 0 and length > MAX_BODY_BYTES then
    return handle:respond({[":status"] = "413"}, "")
  end
  -- A compressed body was read as JSON text ("str is not valid UTF-8"), which says nothing of the cause.
  local encoding = headers:get("content-encoding")
  if encoding and names_a_coding(encoding) and method ~= "GET" and method ~= "HEAD" then
    await_body(handle)
    local named = redacted(encoding):gsub("[^%w%-,; %[%]]", "?"):sub(1, 40)
    return refuse_request(handle, handle:streamInfo():dynamicMetadata(), "Compressed request bodies are not " ..
      "supported (Content-Encoding: " .. named .. "): send the JSON uncompressed.")
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
    local parameters = ORGANIZATION_PARAMETERS[route]
    if parameters and method == "GET" then
      local rewritten, param, fault = organization_query(query, parameters)
      if rewritten == nil then
        return refuse_parameter(handle, metadata, param, fault .. " for GET " .. path .. ": it takes " ..
          ORGANIZATION_NAMES[route] .. ".")
      end
      local name, refusal = range_refusal(rewritten, QUERY_RANGES[route] or {})
      if name then return refuse_parameter(handle, metadata, name, refusal) end
      return headers:replace(":path", path .. "?" .. rewritten)
    end
    local single = (anthropic and ANTHROPIC_MODELS_PARAMETERS[route]) or ADMIN_PARAMETERS[route]
    local repeated = single and method == "GET" and repeated_parameter(query, single)
    if repeated then
      return refuse_parameter(handle, metadata, repeated, "Parameter " .. repeated .. " takes one value, not a " ..
        "list, for GET " .. path .. ".")
    end
    if single and method == "GET" then
      local ranged, refusal = range_refusal(query, QUERY_RANGES[route] or {})
      if ranged then return refuse_parameter(handle, metadata, ranged, refusal) end
    end
    local plain = single and method == "GET" and plain_lists(query, single)
    if plain then headers:replace(":path", path .. "?" .. plain) end
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
  if UNARY_PATHS[route] then return metadata:set("portico", "unary", true) end
  local twin = UNARY_TWINS[route]
  if twin == nil or method ~= "POST" or length == nil or length == 0 or length > UNARY_SCAN_BYTES then return end
  local body = handle:body()
  if body == nil or asks_for_stream(body:getBytes(0, body:length())) then return end
  -- Headers re-fetched: body() yielded. The route stays the same (/v1/); the transcoder maps the new path.
  handle:headers():replace(":path", twin .. (full_path:match("%?.*") or ""))
  handle:streamInfo():dynamicMetadata():set("portico", "unary", true)
end
