-- New orders: a fresh Idempotency-Key on every request ($KEY_PREFIX-thread-n: give each run a
-- prefix of its own), the session cookie from $COOKIE when set.
local counter = 0
local prefix = ""

local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("id", tostring(threads))
end

function init(args)
  prefix = (os.getenv("KEY_PREFIX") or "new") .. "-" .. id .. "-"
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
  wrk.headers["Idempotency-Key"] = prefix .. counter
  return wrk.format(nil, "/orders")
end

