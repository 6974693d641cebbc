-- The error object: its body in either dialect, and the message and param of each of Envoy's own replies.

-- A status without a row (none is expected: every status Envoy or Portico answers has one) keeps its class.
local function kind_of(status)
  return KINDS[status] or (status < 500 and KINDS[400]) or KINDS[500]
    or {"internal_error", "server_error", "The server had an error while processing your request.", "api_error"}
end

-- `message` is a JSON string literal (already quoted and escaped), or nil for the table's default.
local function error_body(status, message, param, anthropic)
  local kind = kind_of(status)
  local object = '{"message":' .. (message or json_string(kind[3])) .. ',"type":"' .. kind[anthropic and 4 or 2] ..
      '","param":' .. json_string(param) .. ',"code":"' .. kind[1] .. '"}'
  if anthropic then return '{"type":"error","error":' .. object .. "}" end
  return '{"error":' .. object .. "}"
end

-- Marks a reply the server never saw (Envoy's own, or a worker that died), for Envoy's access log (envoy.yaml):
-- Portico's access log records every other request itself.
local function mark_envoy_reply(handle, status)
  local metadata = handle:streamInfo():dynamicMetadata()
  metadata:set("portico", "envoy_reply", kind_of(status)[1])
  metadata:set("portico", "envoy_status", status)
end

-- What a caller should have sent, for the protobuf type names in the transcoder's "invalid value" texts.
local EXPECTED = {TYPE_INT64 = "an integer", TYPE_INT32 = "an integer", TYPE_UINT64 = "a non-negative integer",
                  TYPE_UINT32 = "a non-negative integer", TYPE_DOUBLE = "a number", TYPE_FLOAT = "a number",
                  TYPE_BOOL = "true or false", TYPE_STRING = "a string"}
local INTEGER_RANGES = {TYPE_INT32 = "an integer from -2147483648 to 2147483647",
                        TYPE_INT64 = "an integer from -9223372036854775808 to 9223372036854775807",
                        TYPE_UINT32 = "an integer from 0 to 4294967295",
                        TYPE_UINT64 = "an integer from 0 to 18446744073709551615"}

-- Whether some REST binding takes this path (with any method).
local function served_path(path)
  for pattern, _ in pairs(ROUTE_METHODS) do
    if path:find(pattern) then return true end
  end
  return false
end

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
