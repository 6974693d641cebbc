-- The response side: every REST error shaped into the error object (shape_error), gRPC and portico-*
-- metadata kept from HTTP callers, HEAD answers, and Envoy's entry point envoy_on_response.

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

-- The trailers' own headers (e.g. retry-after, x-ratelimit-*) become response headers and leave the trailers; the
-- gRPC and portico-* ones are dropped, so HTTP/2 callers get no trailers of the server's (a header left there too
-- reached them twice: in the headers and again in a trailing HEADERS frame).
local function hoist(trailers, headers)
  local moved = {}  -- collect first: removing while iterating is not allowed
  for key, value in pairs(trailers) do
    if not internal(key) then headers:replace(key, value) end
    moved[#moved + 1] = key
  end
  for _, key in ipairs(moved) do trailers:remove(key) end
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
    -- The virtual host's request-id copies the request's x-request-id: empty when local_reply_config made the id.
    if not headers:get("request-id") then headers:replace("request-id", headers:get("x-request-id") or "") end
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

-- A reply Envoy made to a portico.v1 call (its request cut, over the 16 MiB buffer or not all arrived in time, the
-- server down) gets its access-log line, naming the call: the server never saw it. The gRPC local-reply mappers
-- (gateway/grpc_replies.py) give the row's status in portico-http-status; the server's errors carry portico-error too.
local function note_grpc_reply(handle, portico)
  local headers = handle:headers()
  local status = headers:get("portico-http-status")
  if status and not headers:get("portico-error") then
    mark_envoy_reply(handle, tonumber(status) or 500)
  elseif not portico.envoy_reply then  -- else refuse_cut_message's own reply, marked already
    return
  end
  handle:streamInfo():dynamicMetadata():set("portico", "request", "POST " .. redacted(portico.native_grpc))
  -- The virtual host's request-id copies the request's x-request-id: none when the caller's was removed.
  if not headers:get("request-id") then headers:replace("request-id", headers:get("x-request-id") or "") end
end

function envoy_on_response(handle)
  local portico = handle:streamInfo():dynamicMetadata():get("portico") or {}
  if portico.native_grpc then
    if portico.native_grpc ~= true then note_grpc_reply(handle, portico) end
    return
  end
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
  -- As OpenAI's and Anthropic's APIs send it: no proxy between stores an event stream or serves it again.
  if status < 400 and (handle:headers():get("content-type") or ""):sub(1, 17) == "text/event-stream" then
    handle:headers():replace("cache-control", "no-cache")
  end
  -- HTTP/2 callers would also receive the gRPC trailers (grpc-status, grpc-message). Iterating the chunks does
  -- not buffer the stream, so SSE still flows message by message. HTTP/1.1 drops trailers anyway. (Errors and
  -- unary answers were read whole above: bodyChunks() is not for them.)
  if status < 400 and not unary and not portico.whole and handle:streamInfo():protocol() == "HTTP/2" then
    for _ in handle:bodyChunks() do end
    local trailers = handle:trailers()
    if trailers then strip_internal(trailers) end
  end
end
