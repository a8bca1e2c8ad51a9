-- wrk script: refresh-token requests, each with a token the server has not rotated yet.
--
--   wrk -t1 ... -s bench/refresh_post.lua -H "Authorization: Basic BASE64(id:secret)" URL -- TOKEN_FILE
--
-- A refresh token rotates on every use (a rotated one shown again revokes its family), so
-- the script keeps a queue: a request takes the oldest token, and a 200 answer puts its new
-- refresh token at the back. With more tokens in the file than connections, every
-- connection always finds one. One wrk thread only (the queue is the thread's). A request
-- that finds the queue empty, or an answer other than 200, loses a token and is counted;
-- done() prints the counts (lost=0: every request carried a token the server had issued).

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

queue = {}
first, last = 1, 0
rotated, lost, empty = 0, 0, 0

function init(args)
  local path = args[1]
  if path == nil then
    error("refresh_post.lua: give the token file after --")
  end
  for line in io.lines(path) do
    if line ~= "" then
      last = last + 1
      queue[last] = line
    end
  end
  if last == 0 then
    error("refresh_post.lua: no tokens in " .. path)
  end
end

local function body(token)
  return "grant_type=refresh_token&refresh_token=" .. token
end

-- wrk.format uses the headers it is given instead of wrk.headers (Host, and the -H ones
-- such as Authorization): a copy of those, with the form's content type.
local headers = nil

local function request_headers()
  if headers == nil then
    headers = {}
    for name, value in pairs(wrk.headers) do
      headers[name] = value
    end
    headers["Content-Type"] = "application/x-www-form-urlencoded"
  end
  return headers
end

function request()
  local token = "none"
  if first <= last then
    token = queue[first]
    queue[first] = nil
    first = first + 1
  else
    empty = empty + 1
  end
  return wrk.format("POST", nil, request_headers(), body(token))
end

function response(status, headers, answer)
  local token = status == 200 and string.match(answer, '"refresh_token"%s*:%s*"([^"]+)"')
  if token then
    rotated = rotated + 1
    last = last + 1
    queue[last] = token
  else
    lost = lost + 1
  end
end

function done(summary, latency, requests)
  local r, l, e = 0, 0, 0
  for _, thread in ipairs(threads) do
    r = r + thread:get("rotated")
    l = l + thread:get("lost")
    e = e + thread:get("empty")
  end
  io.write(string.format("Refresh tokens: rotated=%d lost=%d empty=%d\n", r, l, e))
end
