-- Text in JSON bodies and logs: JSON strings, UTF-8 checks, and secrets cut out of what a caller sent.

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

-- A secret pasted into a URL (GET /v1/pk-.../chat) must not reach the access log, nor the 404's message: the path
-- remembered for both has anything shaped like a Portico secret cut out, percent-encoded too (pk%2D..., or every
-- byte escaped, as RFC 3986 allows for the characters a secret is made of). Query strings are never kept.
local function unreserved(hex)
  local char = string.char(tonumber(hex, 16))
  return char:find("^[%w%-._~]$") and char or "%" .. hex
end

-- A header value kept as the caller sent it (its x-request-id): a key is looked for in it as written, as the
-- server's redact_secrets does. Decoded as a path is, `job-pk-%7E1` came back and was logged as `job-pk-~1`, an id
-- the caller never sent (nothing decodes a request id).
local function redacted_as_sent(value)
  if not value:find("pk-", 1, true) then return value end
  return (value:gsub("pk%-[%w_%-]+", "pk-[redacted]"))
end

local function redacted(path)
  local plain = path:find("%", 1, true) and path:gsub("%%(%x%x)", unreserved) or path
  if not plain:find("pk-", 1, true) then return path end
  return redacted_as_sent(plain)
end

-- A value the caller sent, quoted in a message: without a key pasted there, and cut short (a query value may be
-- as long as the 60 KiB of headers).
local function quoted_value(value)
  value = redacted(value)
  if #value > 100 then return value:sub(1, 100) .. "…" end
  return value
end
