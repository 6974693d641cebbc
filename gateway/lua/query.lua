-- A REST request's query, checked where the transcoder would read it otherwise than the caller meant.

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
      -- A name holding a NUL (`%00`) is shown as written: Envoy carries the message as C text, which ended at it.
      local shown = quoted_value(name:find("%z") and pair:match("^[^=]*") or name)  -- maybe as long as the headers
      return nil, shown, "Unknown parameter " .. shown
    end
    local single = not parameters[name]
    if single and (list or seen[name]) then
      return nil, name, "Parameter " .. name .. " takes one value, not a list,"
    end
    seen[name] = true
    rewritten[#rewritten + 1] = name .. rest
  end
  return table.concat(rewritten, "&")
end

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

-- `query` with the list parameters of `parameters` written `name[]=v` (the anthropic SDK's `lifecycle[]`) made
-- `name=v`, which the transcoder reads into the repeated field; other pairs as they came. nil: nothing to change.
local function plain_lists(query, parameters)
  local rewritten, changed = {}, false
  for pair in query:gmatch("[^&]+") do
    local name, list, rest = query_pair(pair)
    if list and parameters[name] == true then
      rewritten[#rewritten + 1], changed = name .. rest, true
    else
      rewritten[#rewritten + 1] = pair
    end
  end
  return changed and table.concat(rewritten, "&") or nil
end

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

-- The first parameter of `query` that is a whole number out of its range in `ranges` (QUERY_RANGES[route]), and the
-- server's message for it, or nil. The server refuses one within the field's int32 or int64 so itself; one beyond
-- it (2147483648) the transcoder refused in protobuf's terms ("expected an integer from -2147483648 to 2147483647"),
-- never the range the caller was told, so all are refused here. Run after the checks that refuse a one-value
-- parameter given twice.
local function range_refusal(query, ranges)
  local names, values = {}, {}
  for pair in query:gmatch("[^&]+") do
    local name, list, rest = query_pair(pair)
    if not list and values[name] == nil then
      names[#names + 1], values[name] = name, unescape(rest:sub(2))
    end
  end
  for _, name in ipairs(names) do
    local range = ranges[name]
    if range and range.by then range = range[values[range.by] or ""] end
    local sign, digits = values[name]:match("^(%-?)0*(%d+)$")
    if range and digits then
      if digits == "0" then sign = "" end  -- "-0" is 0, as the server reads it
      local value = tonumber(digits) * (sign == "-" and -1 or 1)
      if value < range[1] or value > range[2] then
        return name, string.format(range[3], quoted_value(sign .. digits))
      end
    end
  end
  return nil
end
