-- Replays: keys replay-1 .. replay-$KEYS, all created beforehand, sent round and round.
local keys = tonumber(os.getenv("KEYS") or "100")
local counter = 0
local prefix = os.getenv("KEY_PREFIX") or "replay"

function setup(thread)
  thread:set("offset", math.random(0, keys - 1))
end

wrk.method = "POST"
wrk.body = '{"sku":"book","quantity":1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer shop-a-token"
if os.getenv("COOKIE") and os.getenv("COOKIE") ~= "" then
  wrk.headers["Cookie"] = os.getenv("COOKIE")
end

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. "-" .. ((counter + offset) % keys + 1)
  return wrk.format(nil, "/orders")
end
