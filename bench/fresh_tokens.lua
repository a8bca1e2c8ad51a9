-- wrk script: every request carries a different bearer token, read from a file of tokens
-- (one a line), so a verifier cannot answer from its verified-token cache.
--
--   wrk -tT ... -s bench/fresh_tokens.lua URL -- TOKEN_FILE T
--
-- With a third argument, a DPoP-bound access token, the lines are DPoP proofs instead: every
-- request carries `Authorization: DPoP <token>` and a proof of its own (RFC 9449), made
-- beforehand by bench/mkproofs.py, since wrk cannot sign.
--
--   wrk -tT ... -s bench/fresh_tokens.lua URL -- PROOF_FILE T TOKEN
--
-- With T wrk threads, thread k takes lines k, k+T, k+2T, ... so no two threads share a
-- token. wrk runs a thread's init() before it sets up the next thread, so T is passed as
-- an argument. A thread that runs out of tokens starts over and counts a wrap. done()
-- prints the requests sent, the tokens available and the wraps; wraps=0 means no token
-- was sent twice.

local threads = {}
local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("thread_id", thread_count - 1)
  table.insert(threads, thread)
end

requests_built = {}
token_count = 0
next_index = 0
sent = 0
wraps = 0

function init(args)
  local path = args[1]
  if path == nil then
    error("fresh_tokens.lua: give the token file after --")
  end
  local stride = tonumber(args[2] or "1")
  local bound_token = args[3]
  local id = tonumber(thread_id or 0)
  local line_no = 0
  for line in io.lines(path) do
    if line ~= "" then
      if line_no % stride == id then
        token_count = token_count + 1
        local headers = { ["Authorization"] = "Bearer " .. line }
        if bound_token ~= nil then
          headers = { ["Authorization"] = "DPoP " .. bound_token, ["DPoP"] = line }
        end
        requests_built[token_count] = wrk.format(nil, nil, headers)
      end
      line_no = line_no + 1
    end
  end
  if token_count == 0 then
    error("fresh_tokens.lua: no tokens in " .. path)
  end
end

function request()
  next_index = next_index + 1
  if next_index > token_count then
    next_index = 1
    wraps = wraps + 1
  end
  sent = sent + 1
  return requests_built[next_index]
end

function done(summary, latency, requests)
  local total_sent, total_tokens, total_wraps = 0, 0, 0
  for _, thread in ipairs(threads) do
    total_sent = total_sent + thread:get("sent")
    total_tokens = total_tokens + thread:get("token_count")
    total_wraps = total_wraps + thread:get("wraps")
  end
  io.write(string.format("Fresh tokens: sent=%d available=%d wraps=%d\n",
    total_sent, total_tokens, total_wraps))
end
