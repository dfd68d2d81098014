#!/usr/bin/env bash
# The loopback scale test (`make scale-test`): `llamabox serve` replicas on 127.0.0.1,
# each with --threads 1, behind nginx (deploy/loopback/nginx.conf: least_conn, passive
# health checks) and HAProxy (deploy/loopback/haproxy.cfg: active checks on /readyz),
# loaded by wrk (deploy/loopback/chat.lua) for bounded times. It measures
#   1. throughput through nginx with 1 replica, then 2;
#   2. failed requests when one replica is killed with SIGKILL under load (nginx);
#   3. failed requests during a rolling restart under load (SIGTERM, wait for the exit,
#      start again, wait for /readyz), through nginx and through HAProxy;
#   4. client disconnect -> worker return, directly and through each balancer
#      (deploy/loopback/disconnect.py, reading the replicas' /metrics), streamed or not;
#   5. the same with the one balancer setting that breaks it (nginx
#      proxy_ignore_client_abort on, HAProxy without abortonclose / http-no-delay);
# and writes bench/SCALE.md. About 2.5 minutes. Every address is on loopback; every
# load is bounded in time; every process it starts is stopped by its pid on exit.
#
# Inputs (environment):
#   LLAMABOX    the binary (default target/release/llamabox); needs `serve`
#   PLUGIN      the openai plugin (default target/guest/wasm32-wasip2/release/llamabox_openai.wasm)
#   MODEL       a GGUF (default: SmolLM2-135M-Instruct Q4_1 from scripts/fetch-model.sh)
#   DURATION    seconds per throughput / kill phase (default 10)
#   ROLL_DURATION  seconds of load around each rolling restart (default 30)
#   ROLL_PAUSE  seconds between one replica's /readyz and the next one's SIGTERM
#               (default 6: more than nginx's fail_timeout, see docs/DEPLOY.md)
#   CONNS       concurrent wrk connections (default 4)
#   MAX_TOKENS  completion tokens per request (default 32)
#   BASE_PORT   first of the loopback ports used (default 18100: 18100-18105, 18110-18111, 18200-18205)
#   OUT         the report (default bench/SCALE.md)
# Refuses to run while rustc is (a build would take the cores being measured) unless
# SCALE_ALLOW_BUSY=1.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
loop="$root/deploy/loopback"
LLAMABOX="${LLAMABOX:-$root/target/release/llamabox}"
PLUGIN="${PLUGIN:-$root/target/guest/wasm32-wasip2/release/llamabox_openai.wasm}"
DURATION="${DURATION:-10}"
ROLL_DURATION="${ROLL_DURATION:-30}"
ROLL_PAUSE="${ROLL_PAUSE:-6}"
CONNS="${CONNS:-4}"
MAX_TOKENS="${MAX_TOKENS:-32}"
BASE_PORT="${BASE_PORT:-18100}"
OUT="${OUT:-$root/bench/SCALE.md}"

die() { echo "scale-test: $*" >&2; exit 1; }

# ---- prerequisites ----
[ -x "$LLAMABOX" ] || die "no binary at LLAMABOX=$LLAMABOX"
"$LLAMABOX" serve --help >/dev/null 2>&1 || die "$LLAMABOX has no \`serve\` command yet"
[ -s "$PLUGIN" ] || die "no plugin at PLUGIN=$PLUGIN"
MODEL="${MODEL:-$("$root/scripts/fetch-model.sh")}"
[ -s "$MODEL" ] || die "no model at MODEL=$MODEL"
if [ "${SCALE_ALLOW_BUSY:-0}" != 1 ] && pgrep -x rustc >/dev/null; then
  die "rustc is running: a build would distort every figure (SCALE_ALLOW_BUSY=1 to run anyway)"
fi
need=()
command -v nginx >/dev/null || need+=(nginx)
command -v haproxy >/dev/null || need+=(haproxy)
command -v wrk >/dev/null || need+=(wrk)
command -v curl >/dev/null || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
NGINX="$(command -v nginx)"
HAPROXY="$(command -v haproxy)"

PORT_LB1=$BASE_PORT PORT_LB2=$((BASE_PORT + 1)) PORT_HA=$((BASE_PORT + 2))
PORT_A=$((BASE_PORT + 10)) PORT_B=$((BASE_PORT + 11))
for port in $PORT_LB1 $PORT_LB2 $PORT_HA $PORT_A $PORT_B $((BASE_PORT + 3)) $((BASE_PORT + 4)) $((BASE_PORT + 5)) $((BASE_PORT + 103)); do
  ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || die "127.0.0.1:$port is in use (BASE_PORT=...)"
done

tmp="$(mktemp -d /tmp/llamabox-scale.XXXXXX)"
declare -A pid=()          # replica name -> pid
declare -A first_event=()  # balancer -> median ms to the first streamed event
others=()                  # nginx, haproxy, wrk
cleanup() {
  local p
  for p in "${others[@]}" "${pid[@]}"; do
    kill "$p" 2>/dev/null || true
  done
  for p in "${others[@]}" "${pid[@]}"; do
    wait "$p" 2>/dev/null || true
  done
  if [ "${KEEP_TMP:-0}" = 1 ]; then echo "logs kept in $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

port_of() { case $1 in a) echo "$PORT_A" ;; b) echo "$PORT_B" ;; esac; }

calc() { awk "BEGIN { printf \"%.2f\", $1 }"; }
now() { date +%s.%N; }

# Starts replica NAME and waits (at most 120 s) for /readyz; sets $took to the seconds.
# (Not run in $(...): the replica must be this shell's child.)
start_replica() {
  local name=$1 port t0 i; port=$(port_of "$1"); t0=$(now)
  # --max-client-requests 0: behind nginx and HAProxy every request comes from 127.0.0.1,
  # one client to the replica; the balancer is what sees the clients.
  "$LLAMABOX" serve --listen "127.0.0.1:$port" --plugin "openai=$PLUGIN" --model "smollm2=$MODEL" \
    --threads 1 --max-client-requests 0 >>"$tmp/replica-$name.log" 2>&1 &
  pid[$name]=$!
  for ((i = 0; i < 1200; i++)); do
    kill -0 "${pid[$name]}" 2>/dev/null || { tail -20 "$tmp/replica-$name.log" >&2; die "replica $name exited while starting"; }
    if curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" 2>/dev/null; then
      took=$(calc "$(now) - $t0")
      return
    fi
    sleep 0.1
  done
  die "replica $name not ready after 120 s"
}

# SIGTERM, then wait for the exit (at most 30 s); sets $took and $exit_status.
stop_replica() {
  local name=$1 t0 i; t0=$(now)
  kill -TERM "${pid[$name]}"
  for ((i = 0; i < 300; i++)); do
    kill -0 "${pid[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "${pid[$name]}" 2>/dev/null && die "replica $name still running 30 s after SIGTERM"
  exit_status=0
  wait "${pid[$name]}" || exit_status=$?
  unset "pid[$name]"
  took=$(calc "$(now) - $t0")
}

body() {
  printf '{"model":"smollm2","messages":[{"role":"user","content":"Write a short poem about llamas."}],"max_tokens":%d,"temperature":0}' "$MAX_TOKENS"
}
export SCALE_BODY; SCALE_BODY="$(body)"

# wrk against URL for SECONDS; the SCALE_RESULT line goes to $tmp/wrk-LABEL.txt.
wrk_run() {
  local label=$1 url=$2 seconds=$3
  wrk -t1 -c"$CONNS" -d"${seconds}s" --timeout 60s -s "$loop/chat.lua" "$url/v1/chat/completions" \
    >"$tmp/wrk-$label.txt" 2>&1
}
# Field NAME of the SCALE_RESULT line of LABEL (0 when absent).
field() {
  local v
  v=$(grep -o "SCALE_RESULT.*" "$tmp/wrk-$1.txt" | tr ' ' '\n' | sed -n "s/^$2=//p")
  echo "${v:-0}"
}
failed() {  # socket errors + non-2xx responses
  echo $(( $(field "$1" connect_errors) + $(field "$1" read_errors) + $(field "$1" write_errors) + $(field "$1" timeouts) + $(field "$1" non2xx) ))
}
statuses() { grep -o "status_[0-9]*=[0-9]*" "$tmp/wrk-$1.txt" | sed 's/status_//' | sort | tr '\n' ' '; }
rate() { local d; d=$(field "$1" duration_us); [ "$d" -gt 0 ] && calc "$(field "$1" "$2") * 1000000 / $d" || echo 0; }

render() {  # template -> $tmp/NAME
  sed -e "s|@TMP@|$tmp|g; s|@USER@|$(id -un)|g; s|@PORT_LB1@|$PORT_LB1|g; s|@PORT_LB2@|$PORT_LB2|g" \
      -e "s|@PORT_HA@|$PORT_HA|g; s|@PORT_A@|$PORT_A|g; s|@PORT_B@|$PORT_B|g" "$loop/$1" >"$tmp/$1"
}

# ---- start ----
echo "== replicas (127.0.0.1:$PORT_A, :$PORT_B, --threads 1 each)"
start_replica a; ready_a=$took; start_replica b; ready_b=$took
echo "ready after ${ready_a} s and ${ready_b} s"
for port in $PORT_A $PORT_B; do
  code=$(curl -sS -o "$tmp/warm.json" -w '%{http_code}' -H 'Content-Type: application/json' \
    --data "$SCALE_BODY" "http://127.0.0.1:$port/v1/chat/completions")
  [ "$code" = 200 ] || { cat "$tmp/warm.json" >&2; die "a chat completion on :$port answered $code"; }
done
grep -q '"choices"' "$tmp/warm.json" || { cat "$tmp/warm.json" >&2; die "the chat completion has no choices"; }

mkdir -p "$tmp/client_body" "$tmp/proxy" "$tmp/fastcgi" "$tmp/uwsgi" "$tmp/scgi"
render nginx.conf; render haproxy.cfg
"$NGINX" -p "$tmp" -c "$tmp/nginx.conf" -e "$tmp/nginx-error.log" &
others+=($!)
"$HAPROXY" -f "$tmp/haproxy.cfg" -db >"$tmp/haproxy.log" 2>&1 &
others+=($!)
for port in $PORT_LB1 $PORT_LB2 $PORT_HA; do
  for ((i = 0; i < 50; i++)); do
    curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" 2>/dev/null && break
    sleep 0.1
  done
  curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" || die "balancer on :$port does not answer"
done

# ---- 1. throughput ----
echo "== throughput: nginx -> 1 replica, ${DURATION} s"
wrk_run one "http://127.0.0.1:$PORT_LB1" "$DURATION"
echo "== throughput: nginx -> 2 replicas, ${DURATION} s"
wrk_run two "http://127.0.0.1:$PORT_LB2" "$DURATION"

# ---- 2. SIGKILL under load ----
echo "== SIGKILL replica b a third into ${DURATION} s of load (nginx)"
wrk_run kill "http://127.0.0.1:$PORT_LB2" "$DURATION" &
wrk_pid=$!; others+=($wrk_pid)
sleep "$(calc "$DURATION / 3")"
kill -KILL "${pid[b]}"; wait "${pid[b]}" 2>/dev/null || true; unset "pid[b]"
wait "$wrk_pid" || true
# Requests nginx saw fail on b (cut off mid-answer, or refused) and sent on to a.
kill_retried=$(grep -cE 'prematurely closed|Connection refused|reset by peer' "$tmp/nginx-error.log" || true)
start_replica b; restart_b=$took

# ---- 3. rolling restarts under load ----
roll() {  # LABEL URL: restart a, then b, under ROLL_DURATION s of load
  local label=$1 url=$2 name
  wrk_run "$label" "$url" "$ROLL_DURATION" &
  local w=$!; others+=($w)
  # The first restart also waits: nginx still skips a replica for fail_timeout after
  # its last failure (the SIGKILL phase), and with both skipped it answers 502 at once.
  sleep "$ROLL_PAUSE"
  for name in a b; do
    stop_replica "$name"
    echo "$label: replica $name drained and exited in $took s, status $exit_status" | tee -a "$tmp/roll-$label.txt"
    start_replica "$name"
    echo "$label: replica $name ready again after $took s" | tee -a "$tmp/roll-$label.txt"
    sleep "$ROLL_PAUSE"
  done
  wait "$w" || true
}
echo "== rolling restart under ${ROLL_DURATION} s of load: nginx"
roll roll-nginx "http://127.0.0.1:$PORT_LB2"
echo "== rolling restart under ${ROLL_DURATION} s of load: HAProxy"
roll roll-haproxy "http://127.0.0.1:$PORT_HA"

# ---- 4. client disconnect -> worker return ----
# Streamed: the client closes after the first event. Not streamed: it closes 300 ms after
# sending, while the answer is still being generated (the balancer has nothing to write).
metrics="http://127.0.0.1:$PORT_A,http://127.0.0.1:$PORT_B"
for path in direct:$PORT_A nginx:$PORT_LB2 haproxy:$PORT_HA; do
  echo "== disconnect after the first event: ${path%%:*}"
  python3 "$loop/disconnect.py" --url "http://127.0.0.1:${path#*:}" --metrics "$metrics" --trials 3 \
    | tee "$tmp/disconnect-${path%%:*}.jsonl"
  echo "== disconnect before a non-streamed answer: ${path%%:*}"
  python3 "$loop/disconnect.py" --url "http://127.0.0.1:${path#*:}" --metrics "$metrics" --trials 3 \
    --no-stream --close-after-ms 300 --max-tokens 300 --timeout 10 | tee "$tmp/disconnect-${path%%:*}-nostream.jsonl"
done

# ---- 5. the balancer settings that break cancel-on-disconnect, measured ----
# nginx with proxy_ignore_client_abort on; HAProxy without option abortonclose: a client
# that leaves before a non-streamed answer. HAProxy without option http-no-delay: time to
# the first streamed event. Each on its own balancer instance on two more loopback ports.
PORT_V1=$((BASE_PORT + 3)) PORT_V2=$((BASE_PORT + 4)) PORT_V3=$((BASE_PORT + 5))
variant() {  # NAME TEMPLATE PORT SED-EXPRESSION: a balancer from TEMPLATE, changed, on PORT
  local name=$1 template=$2 port=$3 change=$4
  mkdir -p "$tmp/$name"
  sed -e "s|@TMP@|$tmp/$name|g; s|@USER@|$(id -un)|g; s|@PORT_LB1@|$((port + 100))|g; s|@PORT_LB2@|$port|g" \
      -e "s|@PORT_HA@|$port|g; s|@PORT_A@|$PORT_A|g; s|@PORT_B@|$PORT_B|g" -e "$change" "$loop/$template" >"$tmp/$name.conf"
  if [ "$template" = nginx.conf ]; then
    mkdir -p "$tmp/$name/client_body" "$tmp/$name/proxy" "$tmp/$name/fastcgi" "$tmp/$name/uwsgi" "$tmp/$name/scgi"
    "$NGINX" -p "$tmp/$name" -c "$tmp/$name.conf" -e "$tmp/$name/error.log" &
  else
    "$HAPROXY" -f "$tmp/$name.conf" -db >"$tmp/$name.log" 2>&1 &
  fi
  others+=($!)
  for ((i = 0; i < 50; i++)); do
    curl -fsS -o /dev/null "http://127.0.0.1:$port/readyz" 2>/dev/null && return
    sleep 0.1
  done
  die "the $name balancer on :$port does not answer"
}
variant nginx-ignore-abort nginx.conf "$PORT_V1" 's/proxy_ignore_client_abort off/proxy_ignore_client_abort on/'
variant haproxy-no-abortonclose haproxy.cfg "$PORT_V2" '/option abortonclose/d'
variant haproxy-no-nodelay haproxy.cfg "$PORT_V3" '/option http-no-delay/d'
grep -q 'proxy_ignore_client_abort on' "$tmp/nginx-ignore-abort.conf" || die "nginx variant unchanged"
! grep -q 'option abortonclose' "$tmp/haproxy-no-abortonclose.conf" || die "haproxy variant unchanged"
! grep -q 'option http-no-delay' "$tmp/haproxy-no-nodelay.conf" || die "haproxy variant unchanged"
for v in nginx-ignore-abort:$PORT_V1 haproxy-no-abortonclose:$PORT_V2; do
  echo "== disconnect before a non-streamed answer: ${v%%:*}"
  python3 "$loop/disconnect.py" --url "http://127.0.0.1:${v#*:}" --metrics "$metrics" --trials 2 \
    --no-stream --close-after-ms 300 --max-tokens 150 --timeout 10 | tee "$tmp/disconnect-${v%%:*}-nostream.jsonl"
done
echo "== first streamed event and disconnect: haproxy-no-nodelay"
python3 "$loop/disconnect.py" --url "http://127.0.0.1:$PORT_V3" --metrics "$metrics" --trials 2 \
  | tee "$tmp/disconnect-haproxy-no-nodelay.jsonl"
for v in haproxy haproxy-no-nodelay; do  # median time to the first event
  first_event[$v]=$(python3 -c 'import json, statistics, sys; print(round(statistics.median(json.loads(l)["first_event_ms"] for l in open(sys.argv[1]) if "first_event_ms" in l), 1))' "$tmp/disconnect-$v.jsonl")
done

# ---- report ----
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
disc() {  # LABEL -> "cancelled/trials | median ms | max ms | server ms"
  python3 - "$tmp/disconnect-$1.jsonl" <<'PY'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if '"summary"' in l][0]["summary"]
server = s.get("median_server_disconnect_latency_ms")
print(f'{s["cancelled"]}/{s["trials"]} | {s["median_close_to_return_ms"]} | {s["max_close_to_return_ms"]} | {server if server is not None else "n/a"}')
PY
}
mkdir -p "$(dirname "$OUT")"
{
  echo "# Loopback scale test"
  echo
  echo "Written by \`make scale-test\` (scripts/scale-test.sh) on $(date -u '+%Y-%m-%d %H:%M UTC'). Replicas of \`llamabox serve\`"
  echo "on 127.0.0.1, each \`--threads 1\` (one llama.cpp thread: two replicas = the machine's $(nproc) cores),"
  echo "model $(basename "$MODEL"), plugin $(basename "$PLUGIN"); wrk -t1 -c$CONNS, chat completions of"
  echo "$MAX_TOKENS tokens at temperature 0. nginx $("$NGINX" -v 2>&1 | sed 's|.*/||'), HAProxy $("$HAPROXY" -v | head -1 | awk '{print $3}'), configs in deploy/loopback/."
  echo
  echo "- CPU: $cpu, $(nproc) cores; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- binary: $("$LLAMABOX" --version 2>&1 | head -1)"
  echo "- cold start to /readyz: ${ready_a} s and ${ready_b} s (model load + plugin compile or cache hit)"
  echo
  echo "## Throughput through nginx (${DURATION} s each)"
  echo
  echo "| replicas | requests/s | completion tokens/s | p50 ms | p99 ms | failed | statuses |"
  echo "|---|---|---|---|---|---|---|"
  for l in one two; do
    echo "| $([ $l = one ] && echo 1 || echo 2) | $(rate $l requests) | $(rate $l tokens) | $(field $l p50_ms) | $(field $l p99_ms) | $(failed $l) | $(statuses $l)|"
  done
  echo
  echo "Speed-up 1 -> 2 replicas: $(r1=$(rate one requests); [ "$r1" != 0 ] && calc "$(rate two requests) / $r1" || echo "n/a")x in requests/s."
  echo
  echo "## One replica killed (SIGKILL) under load, nginx (${DURATION} s)"
  echo
  echo "Requests completed: $(field kill requests); failed (socket errors + non-2xx): $(failed kill); statuses: $(statuses kill)."
  echo "nginx saw $kill_retried attempts fail on the killed replica (cut off mid-answer or refused) and passed them to the"
  echo "other (\`proxy_next_upstream ... non_idempotent\`: a completion has no side effects)."
  echo "Replica b started again and was ready after ${restart_b} s."
  echo
  echo "## Rolling restart under load (${ROLL_DURATION} s each, ${ROLL_PAUSE} s from one replica's /readyz to the next one's SIGTERM)"
  echo
  echo "| balancer | requests | failed | statuses | steps |"
  echo "|---|---|---|---|---|"
  for l in roll-nginx roll-haproxy; do
    echo "| ${l#roll-} | $(field $l requests) | $(failed $l) | $(statuses $l)| $(sed "s/^$l: //" "$tmp/roll-$l.txt" | paste -sd ';' | sed 's/;/; /g') |"
  done
  echo
  echo "## Client disconnect -> worker return"
  echo
  echo "Streamed: a streaming chat completion (400 tokens asked), the client closes its socket after the first event."
  echo "Not streamed: 300 tokens asked, the client closes 300 ms after sending (no answer yet). Then every replica's"
  echo "/metrics is polled (every ~2 ms) until llamabox_in_flight and llamabox_live_workers are back; cancelled = "
  echo "llamabox_cancels_total{cause=\"disconnect\"} went up (otherwise the generation ran to its end). The time"
  echo "includes one poll round; the last column is the server's own llamabox_disconnect_stop_seconds."
  echo
  echo "| path | request | cancelled by disconnect | median ms | max ms | server: noticed -> stopped, median ms |"
  echo "|---|---|---|---|---|---|"
  for l in direct nginx haproxy; do
    echo "| $l | streamed | $(disc $l) |"
    echo "| $l | not streamed | $(disc $l-nostream) |"
  done
  echo
  echo "## The settings that break it"
  echo
  echo "The same measurement through a balancer with one setting changed (2 trials each; not streamed: 150 tokens asked)."
  echo "Where nothing was cancelled, the time is the rest of the generation, run to its end for a client that had left."
  echo
  echo "| balancer | request | cancelled by disconnect | median ms | max ms | server: noticed -> stopped, median ms |"
  echo "|---|---|---|---|---|---|"
  echo "| nginx, proxy_ignore_client_abort on | not streamed | $(disc nginx-ignore-abort-nostream) |"
  echo "| HAProxy without option abortonclose | not streamed | $(disc haproxy-no-abortonclose-nostream) |"
  echo "| HAProxy without option http-no-delay | streamed | $(disc haproxy-no-nodelay) |"
  echo
  echo "Time to the first streamed event through HAProxy: ${first_event[haproxy]} ms with option http-no-delay,"
  echo "${first_event[haproxy-no-nodelay]} ms without (medians)."
  echo
  echo "## Reading these figures"
  echo
  echo "- Two replicas share the $(nproc) cores with nginx, HAProxy, wrk and their own HTTP runtimes and plugin"
  echo "  instances, so 1 -> 2 replicas gains less than 2x here; on separate machines (or pods with their own cores)"
  echo "  replicas add up. (A 2-vCPU VM's two cores may share one physical core: in bench/RESULTS*.md one generation"
  echo "  on 2 threads runs 1.44x one on 1 thread, not 2x.)"
  echo "- wrk stops with requests in flight at the end of each phase: llamabox sees those clients hang up and"
  echo "  cancels them (llamabox_cancels_total{cause=\"disconnect\"}); they are not failures."
  echo "- The rolling restarts wait ${ROLL_PAUSE} s between replicas: nginx's passive checks skip a replica for"
  echo "  fail_timeout (5 s) after a failure, and with both replicas skipped it answers 502 at once"
  echo "  (docs/DEPLOY.md, \"Balancers\")."
} >"$OUT"
echo "== wrote $OUT"
cat "$OUT"
