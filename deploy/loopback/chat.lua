-- wrk script for scripts/scale-test.sh: POST the chat completion in $SCALE_BODY, count
-- responses by status and the completion tokens they report, and print one line
--   SCALE_RESULT requests=N duration_us=N tokens=N ... status_200=N status_503=N
-- for the script to read. (wrk runs one Lua state per thread: done() sums them.)
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("SCALE_BODY")
assert(wrk.body and #wrk.body > 0, "SCALE_BODY is not set")

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  statuses = {}
  tokens = 0
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  local n = body and body:match('"completion_tokens"%s*:%s*(%d+)')
  if n then
    tokens = tokens + tonumber(n)
  end
end

function done(summary, latency, requests)
  local all, total_tokens = {}, 0
  for _, thread in ipairs(threads) do
    total_tokens = total_tokens + thread:get("tokens")
    for status, n in pairs(thread:get("statuses")) do
      all[status] = (all[status] or 0) + n
    end
  end
  local e = summary.errors
  io.write(string.format(
    "SCALE_RESULT requests=%d duration_us=%d tokens=%d connect_errors=%d read_errors=%d write_errors=%d timeouts=%d non2xx=%d p50_ms=%.1f p99_ms=%.1f",
    summary.requests, summary.duration, total_tokens, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
  for status, n in pairs(all) do
    io.write(string.format(" status_%d=%d", status, n))
  end
  io.write("\n")
end
