#!/usr/bin/env python3
"""`llamabox serve` (the openai plugin) side by side with llama.cpp's `llama-server`.

`make bench-server` runs this; it writes bench/SERVER.md. Python 3 standard library only.
It starts both servers itself, on 127.0.0.1, with the same model, the same llama.cpp
threads in total, the same number of requests computed at once and the same context cap
per request, sends both the same streamed, greedy chat completions, and stops them (by
their pids) when done. Phases (every load is bounded: a fixed number of requests or a
fixed time window):

  1. throughput at concurrency 1 (one request at a time, both threads on it), then at
     concurrency 1, 4 and 8 against two slots of one thread's worth each: p50/p99
     latency, time to first token, completion tokens per second of wall time;
  2. client hang-up during a long prefill (a ~1500-token prompt, unique per request so no
     prompt cache applies) and during generation: time from close() to the server being
     idle again (llamabox: /metrics llamabox_in_flight and llamabox_live_workers back to 0,
     and its own llamabox_disconnect_stop_seconds; llama-server: GET /slots until no slot
     is processing, and /metrics' prompt tokens counted after the hang-up);
  3. at concurrency 2, one client hangs up mid-prefill while another streams a normal
     answer: is the answer identical to its solo answer, and how much slower is it;
  4. goodput under hang-ups: a fixed window at concurrency 4 where 3 of every 10
     requests send a ~1500-token unique prompt and hang up 0.3 s later: completed
     normal requests per minute.

`make bench-serving` (--only-serving) runs instead the field's serving comparison and
writes bench/SERVING.md: llamabox at its defaults against llama-server with a slot per
client and unified KV, at 1 thread and at all cores, open-loop Poisson arrivals at several
rates and closed loops at 1, 4, 8 and 16 clients, in vLLM's metrics (TTFT, TPOT, ITL,
E2EL, goodput at stated SLOs; `serving_metrics` gives the definitions).

Usage: python3 bench/server_bench.py --llamabox BIN --plugin OPENAI.wasm --llama-server BIN
       --model MODEL.gguf [--out bench/SERVER.md] [--threads 2] [--rounds 2]
       [--goodput-seconds 60] [--quick] [--wait-quiet 1800] [--allow-busy]
"""

import argparse
import dataclasses
import datetime
import hashlib
import http.client
import json
import os
import random
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# The keep-alive getter and the Prometheus text parser of the loopback disconnect tool.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy", "loopback"))
from disconnect import Getter, total  # noqa: E402
from disconnect import parse as prometheus  # noqa: E402

SYSTEM = "You are a helpful assistant."
MARKER = "<!-- Notes below are written by hand; `make bench-server` keeps them. -->"


def write_keeping_notes(path, report, target):
    """Writes `report` to `path`, then the marker naming `make target`, then whatever
    `path` held below that marker (the notes written by hand)."""
    marker = MARKER.replace("bench-server", target)
    notes = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if marker in old:
            notes = old.split(marker, 1)[1]
    with open(path, "w") as f:
        f.write(report + "\n" + marker + (notes or "\n"))

BUSY_PATTERN = "rustc|cc1plus|cargo test|/deps/serve-"
MODEL_NAME = "smollm2"

# Prompts. Every request's text is unique from its first message's first word on
# (llama-server reuses the longest common prefix of a slot's last prompt: only ChatML's
# `<|im_start|>system\n` is shared), except in the one run that measures a shared system
# message on purpose.
ANIMALS = "llama alpaca otter heron badger falcon walrus lynx beaver gecko".split()
DEEDS = ["learns to sail", "opens a bakery", "climbs a volcano", "builds a radio", "finds a map",
         "paints the moon", "runs for mayor", "writes a symphony", "fixes a clock", "plants a forest"]
WORDS = ("the of and to in is was for on that with as by at from his her they this which but not are were had "
         "have one all their there been has when who will more no if out so said what up its about into than them "
         "can only other new some could time these two may then do first any my now such like our over man me even "
         "most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year off "
         "come since against go came right used take three").split()
LONG_WORDS = 1470  # about 1490 tokens of user text (each word is one SmolLM2 token), ~1510 with the template


def story(tag):
    r = random.Random(tag)
    return f"Write a short story about a {r.choice(ANIMALS)} who {r.choice(DEEDS)}."


def story_body(tag, max_tokens, shared_system=False):
    """A normal chat: unique from the system message on, or (shared_system) after it."""
    if shared_system:
        return chat_body(f"[{tag}] {story(tag)}", max_tokens)
    return chat_body(story(tag), max_tokens, system=f"[{tag}] {SYSTEM}")


def long_document(tag):
    r = random.Random(tag)
    words = " ".join(r.choice(WORDS) for _ in range(LONG_WORDS))
    return f"Document {tag}. {words}\nSummarize the document above in one sentence."


def chat_body(text, max_tokens, extra=None, system=SYSTEM):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra or {})
    return json.dumps(body).encode()


# ---------------------------------------------------------------- HTTP, by hand


class ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding."""

    def __init__(self):
        self.buf = b""
        self.left = 0  # bytes left of the current chunk's data
        self.state = "size"  # "size" line, chunk "data", its trailing "crlf", or "end"
        self.finished = False

    def feed(self, data):
        self.buf += data
        out = b""
        while True:
            if self.state == "size":
                line, sep, rest = self.buf.partition(b"\r\n")
                if not sep:
                    return out
                self.buf = rest
                self.left = int(line.split(b";")[0].strip() or b"0", 16)
                if self.left == 0:
                    self.state, self.finished = "end", True
                    return out
                self.state = "data"
            elif self.state == "data":
                take = self.buf[: self.left]
                out += take
                self.buf = self.buf[len(take):]
                self.left -= len(take)
                if self.left:
                    return out
                self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return out
                self.buf = self.buf[2:]
                self.state = "size"
            else:
                return out


@dataclasses.dataclass(slots=True, eq=False)
class Result:
    """One streamed request: its times (time.monotonic()) and what came back."""
    status: int | None = None
    t_send: float | None = None
    t_first_byte: float | None = None
    t_first_token: float | None = None
    t_end: float | None = None
    t_close: float | None = None
    text: str = ""
    pieces: int = 0
    piece_times: list[float] = dataclasses.field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached: float | None = None
    finish: str | None = None
    done: bool = False
    error: str | None = None
    hung_up: bool = False

    @property
    def ok(self):
        return self.status == 200 and self.done and self.finish is not None and self.error is None

    @property
    def latency(self):
        return self.t_end - self.t_send

    @property
    def ttft(self):
        return self.t_first_token - self.t_send

    @property
    def per_token(self):
        """Seconds per generated token after the first."""
        if self.t_first_token is None or self.tokens < 2:
            return None
        return (self.t_end - self.t_first_token) / (self.tokens - 1)

    @property
    def tokens(self):
        return self.completion_tokens if self.completion_tokens is not None else self.pieces


def stream_chat(port, body, close_after=None, close_after_pieces=None, timeout=120.0):
    """POST /v1/chat/completions on 127.0.0.1:PORT and read its server-sent events.

    close_after: hang up this many seconds after the request was sent (whatever has
    arrived by then). close_after_pieces: hang up once that many text pieces arrived."""
    r = Result()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = b""
    headers = None
    decoder = None
    content_left = None
    events = b""
    r.t_send = time.monotonic()
    sock.sendall(head + body)
    hard_deadline = r.t_send + timeout
    close_at = r.t_send + close_after if close_after is not None else None

    def hang_up():
        r.t_close = time.monotonic()
        r.hung_up = True
        sock.close()

    try:
        while True:
            now = time.monotonic()
            wait = hard_deadline - now
            if close_at is not None:
                wait = min(wait, close_at - now)
            if wait <= 0:
                if close_at is not None and now >= close_at:
                    hang_up()
                    return r
                r.error = "timed out"
                break
            readable, _, _ = select.select([sock], [], [], wait)
            if not readable:
                continue
            data = sock.recv(65536)
            now = time.monotonic()
            if not data:
                if not r.done:
                    r.error = r.error or "connection closed early"
                break
            if r.t_first_byte is None:
                r.t_first_byte = now
            if headers is None:
                raw += data
                top, sep, rest = raw.partition(b"\r\n\r\n")
                if not sep:
                    continue
                lines = top.decode("latin-1").split("\r\n")
                r.status = int(lines[0].split()[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    decoder = ChunkedDecoder()
                elif "content-length" in headers:
                    content_left = int(headers["content-length"])
                data = rest
            if decoder is not None:
                payload = decoder.feed(data)
            else:
                payload = data
                if content_left is not None:
                    content_left -= len(data)
            events += payload
            while b"\n\n" in events:
                event, _, events = events.partition(b"\n\n")
                for line in event.decode("utf-8", "replace").splitlines():
                    if not line.startswith("data:"):
                        continue
                    value = line[5:].strip()
                    if value == "[DONE]":
                        r.done = True
                        r.t_end = now
                        continue
                    try:
                        obj = json.loads(value)
                    except ValueError:
                        r.error = f"bad event: {value[:200]}"
                        continue
                    if "error" in obj:
                        r.error = json.dumps(obj["error"])[:300]
                    if obj.get("usage"):
                        r.completion_tokens = obj["usage"].get("completion_tokens")
                        r.prompt_tokens = obj["usage"].get("prompt_tokens")
                        r.cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                    for choice in obj.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if r.t_first_token is None:
                                r.t_first_token = now
                            r.text += piece
                            r.pieces += 1
                            r.piece_times.append(now)
                        if choice.get("finish_reason"):
                            r.finish = choice["finish_reason"]
            if r.done:
                break
            if r.status is not None and r.status != 200 and (
                    (decoder is not None and decoder.finished) or (content_left is not None and content_left <= 0)):
                r.error = f"HTTP {r.status}: {events[:300]!r}"
                break
            if close_after_pieces is not None and r.pieces >= close_after_pieces:
                hang_up()
                return r
    except OSError as e:
        r.error = f"{type(e).__name__}: {e}"
    if r.t_end is None:
        r.t_end = time.monotonic()
    sock.close()
    return r


def stop_process(proc):
    """Stops `proc` by its PID: SIGTERM, then SIGKILL if it has not exited in 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the two servers


class Server:
    def __init__(self, kind, argv, log):
        self.kind = kind
        self.argv = argv
        self.log_path = log
        self.proc = None
        self.port = None
        self.getter = None

    @property
    def short(self):
        return "llamabox" if self.kind == "llamabox" else "llama-server"

    def start(self):
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.short} exited at start: {open(self.log_path).read()[-2000:]}")
            if self.kind == "llamabox":
                text = open(self.log_path).read()
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
                if m and "\nready" in text:
                    self.port = int(m.group(1))
                    break
            else:
                try:
                    c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except (OSError, http.client.HTTPException):
                    pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{self.short} did not become ready in 60 s")
        self.getter = Getter("127.0.0.1", self.port, timeout=60, tries=3)

    def stop(self):
        if self.proc:
            stop_process(self.proc)

    def cpu_seconds(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def snapshot(self):
        if self.kind == "llamabox":
            s = prometheus(self.getter.get("/metrics")[1])
            return {
                "busy": total(s, "llamabox_in_flight") + total(s, "llamabox_live_workers"),
                "stop_sum": total(s, "llamabox_disconnect_stop_seconds_sum"),
                "stop_count": total(s, "llamabox_disconnect_stop_seconds_count"),
                "disconnects": total(s, "llamabox_cancels_total", 'cause="disconnect"'),
                "decoded": total(s, "llamabox_tokens_decoded_total"),
                "generated": total(s, "llamabox_tokens_generated_total"),
                "reused": total(s, "llamabox_tokens_reused_total"),
            }
        status, text = self.getter.get("/slots")
        slots = json.loads(text)
        s = prometheus(self.getter.get("/metrics")[1])
        return {
            "busy": sum(1 for slot in slots if slot.get("is_processing")),
            "prompt_tokens": total(s, "llamacpp:prompt_tokens_total"),
            "predicted": total(s, "llamacpp:tokens_predicted_total"),
        }

    def busy(self):
        if self.kind == "llamabox":
            s = prometheus(self.getter.get("/metrics")[1])
            return total(s, "llamabox_in_flight") + total(s, "llamabox_live_workers") > 0
        return any(slot.get("is_processing") for slot in json.loads(self.getter.get("/slots")[1]))

    def wait_idle(self, timeout=60.0, interval=0.005):
        """Poll until the server is idle; seconds waited (None if it never was)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if not self.busy():
                return time.monotonic()
            time.sleep(interval)
        return None


def describe_llamabox(bin_path):
    version = subprocess.run([bin_path, "--version"], capture_output=True, text=True).stdout.strip()
    with open(bin_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    mtime = datetime.datetime.fromtimestamp(os.path.getmtime(bin_path), datetime.timezone.utc)
    return f"{version}, `{bin_path}` (sha256 {digest}…, built {mtime:%Y-%m-%d %H:%M} UTC)"


def describe_llama_server(bin_path):
    out = subprocess.run([bin_path, "--version"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    text = "; ".join(l for l in text if l.startswith(("version", "built")))
    build = os.path.dirname(os.path.dirname(bin_path))
    flags = []
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                m = re.match(r"(GGML_NATIVE|GGML_OPENMP|BUILD_SHARED_LIBS|CMAKE_BUILD_TYPE|CMAKE_C_FLAGS|LLAMA_CURL|LLAMA_OPENSSL):[A-Z]+=(.*)", line)
                if m and m.group(2):
                    flags.append(f"{m.group(1)}={m.group(2)}")
    except OSError:
        pass
    return f"{text}, `{bin_path}` ({', '.join(flags)})"


def cpu_info():
    model, flags = "unknown", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    return model, flags


def machine_busy_seconds():
    """CPU seconds all processes have spent (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """CPU seconds spent by processes other than this one and the measured server."""

    def __init__(self, server):
        self.server = server
        self.start = (machine_busy_seconds(), server.cpu_seconds(), own_cpu_seconds())

    def seconds(self):
        m, s, o = machine_busy_seconds(), self.server.cpu_seconds(), own_cpu_seconds()
        return max(0.0, (m - self.start[0]) - (s - self.start[1]) - (o - self.start[2]))


QUIET = {"budget": 1800.0, "waited": 0.0, "allow": False}


def wait_quiet():
    """Before each measurement: wait while builds or tests run (within the run's budget)."""
    announced = False
    while not QUIET["allow"] and busy_processes() and QUIET["waited"] < QUIET["budget"]:
        if not announced:
            print(f"  waiting for builds/tests to end (pgrep -f '{BUSY_PATTERN}')", flush=True)
            announced = True
        time.sleep(5)
        QUIET["waited"] += 5


def busy_processes():
    out = subprocess.run(["pgrep", "-f", BUSY_PATTERN], capture_output=True, text=True).stdout.split()
    return [p for p in out if int(p) != os.getpid()]


# ---------------------------------------------------------------- statistics


def pct(values, q):
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(-(-q * len(v) // 100)) - 1))
    return v[k]


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values, fmt="{:.2f}"):
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    m = fmt.format(statistics.median(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def ratio(a, b, fmt="{:.2f}×"):
    if a is None or b is None or b == 0:
        return "—"
    return fmt.format(a / b)


# ---------------------------------------------------------------- phases


def closed_loop(server, concurrency, n_requests, tag, max_tokens, shared_system=False):
    """n_requests chats, `concurrency` at a time (each client sends its next when its last
    ended); the results and the wall time."""
    lock = threading.Lock()
    next_index = [0]
    results = []

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= n_requests:
                return
            r = stream_chat(server.port, story_body(f"{tag}-{i}", max_tokens, shared_system))
            with lock:
                results.append(r)

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - start


def load_run(server, concurrency, n_requests, tag, max_tokens, shared_system=False):
    """n_requests chats, `concurrency` at a time; per-run figures."""
    wait_quiet()
    other = OtherLoad(server)
    cpu0 = server.cpu_seconds()
    # llamabox reports prompt tokens it reused from idle contexts in /metrics only.
    reused0 = server.snapshot().get("reused") if server.kind == "llamabox" else None
    results, wall = closed_loop(server, concurrency, n_requests, tag, max_tokens, shared_system)
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    if reused0 is not None and results:
        reused = server.snapshot()["reused"] - reused0
        for r in good:
            r.cached = reused / len(results)  # the run's mean per request
    return {
        "n": len(results),
        "failed": len(results) - len(good),
        "errors": sorted({r.error or f"status {r.status}" for r in results if not r.ok})[:3],
        "p50": pct([r.latency for r in good], 50) if good else None,
        "p99": pct([r.latency for r in good], 99) if good else None,
        "ttft": pct([r.ttft for r in good if r.t_first_token], 50) if good else None,
        "per_token": pct([r.per_token for r in good if r.per_token], 50) if good else None,
        "prompt": med([r.prompt_tokens for r in good]),
        "cached": med([r.cached for r in good]),
        "tps": tokens / wall,
        "latencies": [round(r.latency, 4) for r in results],
        "ttfts": [round(r.ttft, 4) if r.t_first_token else None for r in results],
        "tokens": tokens,
        "wall": wall,
        "cpu": server.cpu_seconds() - cpu0,
        "other_cpu": other.seconds(),
    }


def disconnect_trial(server, phase, tag, close_after_s):
    """One hang-up: close() -> idle, from outside, and the server's own figures."""
    if server.wait_idle() is None:
        raise RuntimeError(f"{server.short} never went idle before a trial")
    wait_quiet()
    before = server.snapshot()
    if phase == "prefill":
        r = stream_chat(server.port, chat_body(long_document(tag), 16), close_after=close_after_s)
    else:
        r = stream_chat(server.port, chat_body(f"[{tag}] Tell me a very long story about a llama who learns to sail.", 400),
                        close_after_pieces=8)
    if not r.hung_up:
        return {"error": f"did not hang up: {r.error or r.finish}"}
    idle = server.wait_idle(interval=0.005)
    after = server.snapshot()
    out = {"close_to_idle": idle - r.t_close if idle else None, "sent_to_close": r.t_close - r.t_send,
           "pieces_before_close": r.pieces}
    # Generated after the close: all generated in the trial less the text events received.
    if server.kind == "llamabox":
        count = after["stop_count"] - before["stop_count"]
        out["own_stop"] = (after["stop_sum"] - before["stop_sum"]) / count if count else None
        out["cancelled"] = after["disconnects"] > before["disconnects"]
        out["prompt_tokens"] = after["decoded"] - before["decoded"]
        out["predicted"] = after["generated"] - before["generated"]
    else:
        out["prompt_tokens"] = after["prompt_tokens"] - before["prompt_tokens"]
        out["predicted"] = after["predicted"] - before["predicted"]
    return out


def isolation_round(server, tag, max_tokens):
    """Solo answer of B, then B again while A hangs up mid-prefill beside it."""
    extra = {"cache_prompt": False} if server.kind == "llama-server" else None
    body_b = chat_body("Explain in a few sentences why llamas are good pack animals.", max_tokens, extra)
    server.wait_idle()
    wait_quiet()
    solo = stream_chat(server.port, body_b)
    server.wait_idle()
    hung = {}

    def client_a():
        hung["r"] = stream_chat(server.port, chat_body(long_document(f"{tag}-A"), 16), close_after=0.5)

    a = threading.Thread(target=client_a)
    a.start()
    time.sleep(0.1)
    together = stream_chat(server.port, body_b)
    a.join()
    server.wait_idle()
    return {
        "solo_ok": solo.ok, "together_ok": together.ok, "a_hung_up": hung["r"].hung_up,
        "identical": solo.ok and together.ok and solo.text == together.text,
        "solo_latency": solo.latency, "together_latency": together.latency,
        "solo_ttft": solo.ttft if solo.t_first_token else None,
        "together_ttft": together.ttft if together.t_first_token else None,
        "tokens": together.tokens, "solo_text": solo.text[:80],
    }


def goodput(server, seconds, concurrency, tag, max_tokens):
    """A fixed window at `concurrency`; requests 3, 6, 9 of every 10 hang up 0.3 s into a long prefill."""
    lock = threading.Lock()
    counter = [0]
    stats = {"completed": 0, "late": 0, "failed": 0, "hung_up": 0, "errors": set(), "latencies": []}
    wait_quiet()
    other = OtherLoad(server)
    cpu0 = server.cpu_seconds()
    start = time.monotonic()
    end = start + seconds

    def worker():
        while time.monotonic() < end:
            with lock:
                i = counter[0]
                counter[0] += 1
            if i % 10 in (2, 5, 8):
                r = stream_chat(server.port, chat_body(long_document(f"{tag}-{i}"), 16), close_after=0.3)
                with lock:
                    if r.hung_up:
                        stats["hung_up"] += 1
                    elif not r.ok:  # failed within 0.3 s
                        stats["failed"] += 1
                        stats["errors"].add(r.error or f"status {r.status}")
                        time.sleep(0.1)  # a client backs off after an error
                continue
            r = stream_chat(server.port, story_body(f"{tag}-{i}", max_tokens))
            with lock:
                if not r.ok:
                    stats["failed"] += 1
                    stats["errors"].add(r.error or f"status {r.status}")
                    stats["first_failure"] = min(stats.get("first_failure", 1e9), r.t_send - start)
                elif r.t_end <= end:
                    stats["completed"] += 1
                    stats["latencies"].append(r.latency)
                else:
                    stats["late"] += 1
            if not r.ok:
                time.sleep(0.1)  # a client backs off after an error

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["cpu"] = server.cpu_seconds() - cpu0
    stats["wall"] = time.monotonic() - start
    stats["other_cpu"] = other.seconds()
    server.wait_idle(timeout=120)
    if server.kind == "llamabox":
        stats["queue_after"] = total(prometheus(server.getter.get("/metrics")[1]), "llamabox_queue_depth")
    stats["sent"] = counter[0]
    stats["per_minute"] = stats["completed"] * 60.0 / seconds
    stats["errors"] = sorted(stats["errors"])[:3]
    return stats


# ---------------------------------------------------------------- the run


def serving_metrics(results, window, slo_ttft, slo_tpot):
    """vLLM's serving metrics (benchmarks/benchmark_serving.py's definitions) of `results`:
    TTFT = first content piece − send; TPOT = (E2EL − TTFT) / (output tokens − 1), per
    request with at least 2 tokens; ITL = every gap between consecutive content pieces;
    E2EL = last content piece − send; goodput = requests per second of `window` that met
    TTFT ≤ slo_ttft and TPOT ≤ slo_tpot (seconds). Failed requests count in `failed` only."""
    good = [r for r in results if r.ok and r.piece_times]
    ttft = [r.t_first_token - r.t_send for r in good]
    e2el = [r.piece_times[-1] - r.t_send for r in good]
    tpot = [(r.piece_times[-1] - r.t_first_token) / (r.tokens - 1) for r in good if r.tokens > 1]
    itl = [b - a for r in good for a, b in zip(r.piece_times, r.piece_times[1:])]
    met = [r for r in good if r.t_first_token - r.t_send <= slo_ttft
           and (r.tokens < 2 or (r.piece_times[-1] - r.t_first_token) / (r.tokens - 1) <= slo_tpot)]
    span = (max(r.piece_times[-1] for r in good) - min(r.t_send for r in good)) if good else 0

    def q(values, p):
        return pct(values, p) if values else None
    return {
        "n": len(results), "failed": len(results) - len(good),
        "errors": sorted({r.error or f"status {r.status}" for r in results if not (r.ok and r.piece_times)})[:3],
        "ttft50": q(ttft, 50), "ttft99": q(ttft, 99), "tpot50": q(tpot, 50), "tpot99": q(tpot, 99),
        "itl50": q(itl, 50), "itl99": q(itl, 99), "e2el50": q(e2el, 50), "e2el99": q(e2el, 99),
        "tps": sum(r.tokens for r in good) / span if span else 0.0,
        "goodput": len(met) / window, "req_rate": len(good) / span if span else 0.0,
    }


def open_loop_run(server, rate, seconds, tag, max_tokens, seed, slo_ttft, slo_tpot):
    """Poisson arrivals at `rate` requests per second for `seconds` (a fixed schedule from
    `seed`, the same for both servers); each request is sent at its time whatever the
    others are doing (open loop), and read to its end."""
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    results, lock = [], threading.Lock()

    def one(i):
        r = stream_chat(server.port, story_body(f"{tag}-{i}", max_tokens))
        with lock:
            results.append(r)

    wait_quiet()
    start = time.monotonic()
    threads = []
    for i, at in enumerate(times):
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return serving_metrics(results, seconds, slo_ttft, slo_tpot)


def closed_loop_metrics(server, concurrency, n_requests, tag, max_tokens, slo_ttft, slo_tpot):
    """`n_requests` chats, `concurrency` at a time, in serving_metrics' terms."""
    wait_quiet()
    results, wall = closed_loop(server, concurrency, n_requests, tag, max_tokens)
    return serving_metrics(results, wall, slo_ttft, slo_tpot)


def serving_phase(args, tmp):
    """llamabox at its defaults against llama-server at its best for these loads (a slot
    per client, up to the highest concurrency, with unified KV), at 1 thread and at all
    cores: open-loop Poisson rates, then closed loops at 1, 4, 8 and 16."""
    rates = [float(x) for x in args.poisson_rates.split(",") if x]
    levels = [int(c) for c in args.closed_levels.split(",") if c]
    slots = max(levels + [16])
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    out, argv = {}, {}
    for threads in sorted({1, args.threads}):
        lb = Server("llamabox", [args.llamabox, "serve", "--listen", "127.0.0.1:0", "--plugin", f"openai={args.plugin}",
                                 "--model", f"{MODEL_NAME}={args.model}", "--threads", str(threads), *args.llamabox_arg],
                    os.path.join(tmp, f"llamabox-serving-t{threads}.log"))
        port = free_port()
        ls = Server("llama-server", [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                                     "-t", str(threads), "-np", str(slots), "-c", str(args.n_ctx * slots), "-kvu",
                                     "--metrics", "--no-webui"],
                    os.path.join(tmp, f"llama-server-serving-t{threads}.log"))
        ls.port = port
        pair = [lb, ls]
        try:
            for s in pair:
                s.start()
                load_run(s, 4, 8, f"warm-serving-{s.short}-t{threads}", args.max_tokens)
            argv[threads] = [s.argv for s in pair]
            for k, rate in enumerate(rates):
                for r in range(args.serving_rounds):
                    for s in (pair if (k + r) % 2 == 0 else pair[::-1]):
                        print(f"open loop {rate}/s, {threads} thread(s), round {r + 1}: {s.short}", flush=True)
                        out.setdefault((threads, "rate", rate, s.short), []).append(open_loop_run(
                            s, rate, args.poisson_seconds, f"ol{threads}-{rate}-{r}", args.max_tokens,
                            seed=1000 * k + r, slo_ttft=slo_ttft, slo_tpot=slo_tpot))
            for k, c in enumerate(levels):
                for r in range(args.serving_rounds):
                    for s in (pair if (k + r) % 2 == 0 else pair[::-1]):
                        print(f"closed loop c={c}, {threads} thread(s), round {r + 1}: {s.short}", flush=True)
                        out.setdefault((threads, "closed", c, s.short), []).append(closed_loop_metrics(
                            s, c, args.per_level * c, f"cl{threads}-{c}-{r}", args.max_tokens, slo_ttft, slo_tpot))
        finally:
            for s in pair:
                s.stop()
    return out, argv


def render_serving(args, out, argv, started_at, finished_at, builds):
    model, _ = cpu_info()
    lines = [
        "# Serving in the field's terms: llamabox at its defaults vs llama-server at its best", "",
        f"Written by `make bench-serving` (bench/server_bench.py --only-serving) on "
        f"{started_at:%Y-%m-%d %H:%M} UTC, {(finished_at - started_at).total_seconds() / 60:.1f} minutes.", "",
        f"- CPU: {model}, {os.cpu_count()} cores; both servers at 1 thread and at {args.threads}, one at a time.",
        f"- llamabox: {builds['llamabox']}, `serve` at its defaults (only `--threads`): its batch, its "
        f"seats sized by its defaults, its admission.",
        f"- llama-server: {builds['llama-server']}, one slot per client up to the highest concurrency "
        f"(`-np {max([int(c) for c in args.closed_levels.split(',') if c] + [16])}`), unified KV (`-kvu`), "
        f"`-c` = {args.n_ctx} per slot.",
        f"- Requests: streamed greedy chats, unique from the first word, `max_tokens` {args.max_tokens}. "
        f"Open loop: Poisson arrivals for {args.poisson_seconds:.0f} s per rate (the same schedule for both "
        f"servers); closed loop: {args.per_level}·c requests at concurrency c. Medians of "
        f"{args.serving_rounds} rounds per row, the servers alternating which goes first.",
        "- Metrics as vLLM's benchmark_serving.py defines them: TTFT (send → first content piece), TPOT "
        "((E2EL − TTFT)/(tokens − 1), per request), ITL (every gap between content pieces), E2EL (send → last "
        f"piece); goodput: requests per second that met TTFT ≤ {args.slo_ttft_ms:.0f} ms and TPOT ≤ "
        f"{args.slo_tpot_ms:.0f} ms. Times in ms. Ratios are llamabox / llama-server (below 1.00× is "
        "better for times, above for tokens/s and goodput).", "",
        "Command lines:", ""]
    for threads, pair in sorted(argv.items()):
        for a in pair:
            lines.append(f"- {threads} thread(s): `{' '.join(os.path.basename(x) if i == 0 else x for i, x in enumerate(a))}`")
    keys = ["ttft50", "ttft99", "tpot50", "tpot99", "itl50", "itl99", "e2el50", "e2el99", "tps", "goodput"]

    def medk(runs, k):
        vals = [r[k] for r in runs if r[k] is not None]
        return statistics.median(vals) if vals else None

    def cell(v, k):
        if v is None:
            return "–"
        return f"{v:.2f}" if k in ("tps", "goodput") else f"{v * 1e3:.0f}"

    for threads in sorted({k[0] for k in out}):
        for kind, title in (("rate", "Open loop, Poisson arrivals (rate: requests/s)"),
                            ("closed", "Closed loop (c: concurrent clients)")):
            xs = sorted({k[2] for k in out if k[0] == threads and k[1] == kind})
            if not xs:
                continue
            lines += ["", f"## {threads} thread(s): {title}", "",
                      "| " + ("rate" if kind == "rate" else "c") + " | server | failed | TTFT p50 | TTFT p99 | TPOT p50 "
                      "| TPOT p99 | ITL p50 | ITL p99 | E2EL p50 | E2EL p99 | tokens/s | goodput req/s |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for x in xs:
                rows = {s: out.get((threads, kind, x, s), []) for s in ("llamabox", "llama-server")}
                meds = {s: {k: medk(runs, k) for k in keys} for s, runs in rows.items() if runs}
                for s, runs in rows.items():
                    if runs:
                        failed = sum(r["failed"] for r in runs)
                        lines.append(f"| {x:g} | {s} | {failed} | " + " | ".join(cell(meds[s][k], k) for k in keys) + " |")
                if len(meds) == 2:
                    a, b = meds["llamabox"], meds["llama-server"]
                    lines.append(f"| {x:g} | **ratio** | | " + " | ".join(
                        (f"{a[k] / b[k]:.2f}×" if a[k] is not None and b[k] else "–") for k in keys) + " |")
    errors = sorted({e for runs in out.values() for r in runs for e in r["errors"]})
    if errors:
        lines += ["", "Errors seen: " + "; ".join(errors[:5])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamabox", required=True)
    ap.add_argument("--plugin", required=True, help="the openai plugin (llamabox_openai.wasm)")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="bench/SERVER.md")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads of each server in total")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per request (llama-server: per slot)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the throughput and disconnect phases")
    ap.add_argument("--per-level", type=int, default=8, help="requests per concurrency level: this × c")
    ap.add_argument("--goodput-seconds", type=float, default=60)
    ap.add_argument("--quick", action="store_true", help="a few seconds per phase (to try the script)")
    ap.add_argument("--wait-quiet", type=float, default=1800,
                    help=f"wait up to this many seconds for no process matching '{BUSY_PATTERN}'")
    ap.add_argument("--allow-busy", action="store_true", help="measure even if builds or tests are running")
    ap.add_argument("--llamabox-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for `llamabox serve` (repeatable), e.g. --llamabox-arg=--idle-contexts=0")
    ap.add_argument("--batch-levels", default="1,4,8,16",
                    help="concurrency levels of the batched phase (both servers batch as many slots as clients)")
    ap.add_argument("--only-batched", action="store_true", help="run only the batched phase")
    ap.add_argument("--only-serving", action="store_true",
                    help="run only the serving phase (open loop and closed loop, llamabox at its defaults): "
                         "writes --serving-out")
    ap.add_argument("--serving-out", default="bench/SERVING.md")
    ap.add_argument("--poisson-rates", default="0.5,1,2,4", help="open-loop arrival rates, requests per second")
    ap.add_argument("--poisson-seconds", type=float, default=40)
    ap.add_argument("--closed-levels", default="1,4,8,16")
    ap.add_argument("--serving-rounds", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000)
    ap.add_argument("--slo-tpot-ms", type=float, default=100)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.per_level, args.goodput_seconds = 1, 2, 8
    QUIET["budget"], QUIET["allow"] = args.wait_quiet, args.allow_busy
    builds = {"llamabox": describe_llamabox(args.llamabox), "llama-server": describe_llama_server(args.llama_server)}

    waited = 0.0
    while busy_processes() and not args.allow_busy:
        if waited >= args.wait_quiet:
            sys.exit(f"server_bench: builds or tests still running after {waited:.0f} s "
                     f"(pgrep -f '{BUSY_PATTERN}'); --allow-busy to measure anyway")
        if waited % 60 == 0:
            print(f"waiting for a quiet machine (pgrep -f '{BUSY_PATTERN}': {' '.join(busy_processes())})", flush=True)
        time.sleep(15)
        waited += 15

    started_at = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    busy_seen = []
    tmp = tempfile.mkdtemp(prefix="llamabox-server-bench.")
    two = max(1, args.threads // 2)  # one thread's worth per slot on 2 cores
    slots = args.threads // two
    if args.only_serving:
        out, argv = serving_phase(args, tmp)
        finished_at = datetime.datetime.now(datetime.timezone.utc)
        with open(os.path.join(tmp, "serving.json"), "w") as f:
            json.dump({"|".join(map(str, k)): v for k, v in out.items()}, f, indent=1)
        write_keeping_notes(args.serving_out, render_serving(args, out, argv, started_at, finished_at, builds),
                            "bench-serving")
        print(f"wrote {args.serving_out}; server logs in {tmp}")
        return

    def server_pair(label, n_slots, llamabox_flags):
        """llamabox with `llamabox_flags` and llama-server with `n_slots` slots, both on all threads."""
        lb = Server("llamabox", [args.llamabox, "serve", "--listen", "127.0.0.1:0", "--plugin", f"openai={args.plugin}",
                                 "--model", f"{MODEL_NAME}={args.model}", "--threads", str(args.threads),
                                 *llamabox_flags, "--plugin-env", f"LLAMABOX_N_CTX={args.n_ctx}",
                                 # One load generator is one client; and llama-server's queue
                                 # has no timeout: queue as the earlier reports did (30 s).
                                 "--max-client-requests", "0", "--queue-timeout-ms", "30000",
                                 *args.llamabox_arg],
                    os.path.join(tmp, f"llamabox-{label}.log"))
        port = free_port()
        ls = Server("llama-server", [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                                     "-t", str(args.threads), "-np", str(n_slots), "-c", str(args.n_ctx * n_slots),
                                     "--metrics", "--no-webui"],
                    os.path.join(tmp, f"llama-server-{label}.log"))
        ls.port = port
        return lb, ls

    def servers(request_threads, n_slots, label):
        """The unbatched control: each llamabox request on a context of its own."""
        return server_pair(label, n_slots, ["--request-threads", str(request_threads), "--batch", "false"])

    def batched_servers(c):
        """Both servers batching `c` slots into one decode per step on all threads."""
        return server_pair(f"batch{c}", c, ["--batch", "true", "--batch-seats", str(c), "--batch-n-ctx", str(args.n_ctx)])

    def note_busy(phase):
        if busy_processes():
            busy_seen.append(phase)

    def both(pair, r):
        """Alternate which server goes first, round by round."""
        return pair if r % 2 == 0 else pair[::-1]

    results = {"load": {}, "disconnect": {}, "isolation": {}, "goodput": {},
               "batched": {}, "batched_disconnect": {}, "batched_isolation": {}, "batched_goodput": {}}
    argv = {}
    running = []
    levels = [int(c) for c in args.batch_levels.split(",") if c]
    try:
        # ---- both batched, as many slots as clients: the issue-24 comparison
        for c in levels:
            pair = batched_servers(c)
            for s in pair:
                s.start()
                running.append(s)
            argv[f"batch{c}"] = [s.argv for s in pair]
            for s in pair:
                load_run(s, c, 2 * c, f"warmb{c}-{s.short}", args.max_tokens)
            for r in range(args.rounds):
                for s in both(pair, r):
                    print(f"batched throughput c={c} ({c} slots), round {r + 1}: {s.short}", flush=True)
                    results["batched"].setdefault((c, s.short), []).append(
                        load_run(s, c, args.per_level * c, f"b{c}-r{r}", args.max_tokens))
            if c == 4:
                trials = max(3, args.rounds) if not args.quick else 1
                for t in range(trials):
                    for s in both(pair, t):
                        print(f"batched hang-up during prefill, trial {t + 1}: {s.short}", flush=True)
                        results["batched_disconnect"].setdefault(s.short, []).append(
                            disconnect_trial(s, "prefill", f"bdc-{t}-{s.short}", 0.5))
                        print(f"batched isolation, round {t + 1}: {s.short}", flush=True)
                        results["batched_isolation"].setdefault(s.short, []).append(
                            isolation_round(s, f"biso-{t}-{s.short}", 64))
                for s in pair:
                    print(f"batched goodput under hang-ups, {args.goodput_seconds:.0f} s: {s.short}", flush=True)
                    results["batched_goodput"][s.short] = goodput(s, args.goodput_seconds, 4, f"bgp-{s.short}", args.max_tokens)
            note_busy(f"batched c={c}")
            for s in pair:
                s.stop()
                running.remove(s)
        if args.only_batched:
            raise StopIteration
        # ---- one slot with every thread: concurrency 1
        pair = servers(args.threads, 1, "1slot")
        for s in pair:
            s.start()
            running.append(s)
        argv["1slot"] = [s.argv for s in pair]
        print("warm-up", flush=True)
        for s in pair:
            load_run(s, 1, 2, f"warm-{s.short}", args.max_tokens)
        for r in range(args.rounds):
            for s in both(pair, r):
                print(f"throughput c=1 (1 slot × {args.threads} threads), round {r + 1}: {s.short}", flush=True)
                results["load"].setdefault(("1slot", 1, s.short), []).append(
                    load_run(s, 1, args.per_level, f"t1-r{r}", args.max_tokens))
            for s in both(pair, r + 1):
                print(f"throughput c=1, shared system message, round {r + 1}: {s.short}", flush=True)
                results["load"].setdefault(("1slot-shared", 1, s.short), []).append(
                    load_run(s, 1, args.per_level, f"t1s-r{r}", args.max_tokens, shared_system=True))
        note_busy("concurrency 1 (1 slot)")
        for s in pair:
            s.stop()
            running.remove(s)

        # ---- `slots` slots of one thread's worth each: everything else
        pair = servers(two, slots, "slots")
        for s in pair:
            s.start()
            running.append(s)
        argv["slots"] = [s.argv for s in pair]
        for s in pair:
            load_run(s, slots, 2 * slots, f"warm2-{s.short}", args.max_tokens)
        for r in range(args.rounds):
            for c in (1, 4, 8):
                for s in both(pair, r + c):
                    print(f"throughput c={c} ({slots} slots), round {r + 1}: {s.short}", flush=True)
                    results["load"].setdefault(("slots", c, s.short), []).append(
                        load_run(s, c, args.per_level * c, f"t{c}-r{r}", args.max_tokens))
        note_busy("throughput (2 slots)")

        trials = max(3, args.rounds) if not args.quick else 1
        for phase in ("prefill", "generation"):
            for t in range(trials):
                for s in both(pair, t):
                    print(f"hang-up during {phase}, trial {t + 1}: {s.short}", flush=True)
                    results["disconnect"].setdefault((phase, s.short), []).append(
                        disconnect_trial(s, phase, f"dc-{phase}-{t}-{s.short}", 0.5))
        note_busy("hang-ups")

        for t in range(max(3, args.rounds) if not args.quick else 1):
            for s in both(pair, t):
                print(f"isolation at concurrency 2, round {t + 1}: {s.short}", flush=True)
                results["isolation"].setdefault(s.short, []).append(isolation_round(s, f"iso-{t}-{s.short}", 64))
        note_busy("isolation")

        for s in pair:
            print(f"goodput under hang-ups, {args.goodput_seconds:.0f} s: {s.short}", flush=True)
            results["goodput"][s.short] = goodput(s, args.goodput_seconds, 4, f"gp-{s.short}", args.max_tokens)
        note_busy("goodput")
        for s in pair:
            s.stop()
            running.remove(s)
    except StopIteration:
        pass
    finally:
        for s in running:
            s.stop()

    finished_at = datetime.datetime.now(datetime.timezone.utc)
    with open(os.path.join(tmp, "results.json"), "w") as f:
        json.dump({f"{name}|" + ("|".join(map(str, k)) if isinstance(k, tuple) else k): v
                   for name, part in results.items() for k, v in part.items()}, f, indent=1, default=str)
    report = render(args, results, argv, started_at, finished_at, load_start, os.getloadavg(), busy_seen, slots, two, builds)
    write_keeping_notes(args.out, report, "bench-server")
    print(f"wrote {args.out} ({(finished_at - started_at).total_seconds():.0f} s); server logs in {tmp}")


def table_head(w, *columns):
    """Writes a Markdown table's header row and its separator, one cell per column."""
    w("| " + " | ".join(columns) + " |")
    w("|" + " --- |" * len(columns))


def render(args, results, argv, started_at, finished_at, load_start, load_end, busy_seen, slots, two, builds):
    model_name, flags = cpu_info()
    simd = [f for f in flags if re.match(r"(sse|ssse|avx|fma|f16c|bmi|amx)", f)]
    L = []
    w = L.append
    w("# llamabox serve vs llama.cpp's llama-server")
    w("")
    w(f"Written by `make bench-server` (bench/server_bench.py) on {started_at:%Y-%m-%d %H:%M} UTC, "
      f"{(finished_at - started_at).total_seconds() / 60:.1f} minutes.")
    w("")
    w("How to run: `make bench-server` (builds llamabox and the plugins, builds llama-server once "
      "with bench/llama-server.sh into ~/.cache/llamabox, then runs bench/server_bench.py; about 8 minutes "
      "on a quiet 2-core machine). `LLAMABOX=`, `PLUGIN=`, `MODEL=` override the binary, the openai plugin "
      "and the model; `SERVER_BENCH_ARGS=` passes flags (`python3 bench/server_bench.py --help`). It waits "
      f"(up to 30 minutes) until nothing matches `pgrep -f '{BUSY_PATTERN}'` before measuring.")
    w("")
    w(f"- CPU: {model_name}, {os.cpu_count()} cores; SIMD flags: {' '.join(simd)}")
    w(f"- load average at start {' '.join(f'{x:.2f}' for x in load_start)}, at end "
      f"{' '.join(f'{x:.2f}' for x in load_end)}; builds or tests seen running during: "
      f"{', '.join(busy_seen) if busy_seen else 'none'}")
    w(f"- llamabox: {builds['llamabox']}; plugin `{args.plugin}`")
    w(f"- llama-server: {builds['llama-server']}")
    other = [r["other_cpu"] / r["wall"] for part in ("load", "batched") for runs in results[part].values() for r in runs]
    other += [g["other_cpu"] / g["wall"] for g in results["goodput"].values()]
    w(f"- other processes' CPU while measuring (from /proc/stat, less this script and the measured server), "
      f"in cores: median {med(other) or 0:.2f}, max {max(other or [0]):.2f} over the throughput runs and goodput "
      f"windows; waited {QUIET['waited']:.0f} s in all for builds/tests to end before measurements")
    w(f"- model: `{args.model}`")
    w("")
    w("<details><summary>all CPU flags</summary>")
    w("")
    w(" ".join(flags))
    w("")
    w("</details>")
    w("")
    w("## Settings, and why they are a fair comparison")
    w("")
    w(f"- Threads: each server gets {args.threads} llama.cpp threads in total (`--threads {args.threads}` / `-t {args.threads}`), "
      "the machine's cores; they run one at a time, never both under load.")
    w(f"- Requests computed at once: the same for both. Concurrency 1 runs against one slot with all "
      f"{args.threads} threads (llamabox `--request-threads {args.threads}`, llama-server `-np 1`). Every other "
      f"phase runs against {slots} slots (llamabox `--request-threads {two}`: {args.threads} / {two} = {slots} requests "
      f"at once, each on its own context and {two} thread(s); llama-server `-np {slots}`: {slots} sequences batched "
      f"into one decode on all {args.threads} threads). Requests beyond that wait in each server's queue.")
    w(f"- Context: {args.n_ctx} tokens per request on both (llama-server `-c {args.n_ctx} × slots`, split per slot; "
      f"llamabox `LLAMABOX_N_CTX={args.n_ctx}`, the openai plugin's cap; it sizes each context to prompt + max_tokens, "
      "rounded up to 256 cells).")
    w("- Prompt reuse: llama-server's prompt cache (a slot keeps its last prompt's KV) against llamabox's idle "
      "contexts (each model keeps up to `--threads` contexts that requests dropped, for the next request of "
      "the same tenant and context size, which reuses the longest common token prefix). Both on by default.")
    w(f"- Requests: chat completions, `stream: true` with usage, `temperature: 0` (greedy on both), "
      f"`max_tokens: {args.max_tokens}` for normal chats, the same explicit system message (so both apply "
      "the same ChatML text: without one, llama-server's Jinja template adds SmolLM2's default system "
      "prompt and llamabox's built-in template does not). Every user message is unique and starts with "
      "what makes it unique, so llama-server's prompt cache can reuse only the shared system message. "
      f"Long prompts: {LONG_WORDS} one-token words, about 1510 tokens with the template.")
    w("- Both servers otherwise at their defaults (llama-server: flash attention auto, n_batch 2048, "
      "n_ubatch 512, prompt cache in RAM on; `--metrics` added, `/slots` is on by default).")
    w(f"- Rounds: {args.rounds} of each throughput level ({args.per_level}·c requests each), "
      "the servers alternating which goes first; medians of the rounds, (min–max).")
    w("- Command lines:")
    for key in [k for k in argv if k.startswith("batch")] + ["1slot", "slots"]:
        for a in argv.get(key, []):
            w(f"  - `{' '.join(os.path.basename(x) if i == 0 else x for i, x in enumerate(a))}`")
    w("")

    # ---- batched
    if results["batched"]:
        w("## Batched: every running request in one decode per step, on both servers")
        w("")
        w("Both servers batch as many slots as there are clients: llama-server `-np c -c "
          f"{args.n_ctx}×c` (its slots are sequences of one context, one `llama_decode` per step), llamabox "
          f"`--batch true --batch-seats c --batch-n-ctx {args.n_ctx}` (each request's context is a seat, a sequence of "
          "one shared context per model, one `llama_decode` per step on all threads; a cancel stops the step in "
          f"flight, rolls it back for every seat and re-runs the others). {args.threads} threads in all on each, "
          "no per-request thread setting. Columns as in the unbatched table below; medians of the rounds (min–max).")
        w("")
        table_head(w, "concurrency = slots", "server", "requests", "p50 s", "p99 s", "TTFT p50 s", "ms/token",
                   "tokens/s", "failed", "other load, cores")
        bsum = {}
        levels = sorted({c for c, _ in results["batched"]})
        for c in levels:
            for name in ("llamabox", "llama-server"):
                runs = results["batched"].get((c, name), [])
                if not runs:
                    continue
                failed = sum(r["failed"] for r in runs)
                errs = sorted({e for r in runs for e in r["errors"]})
                w(f"| {c} | {name} | {runs[0]['n']} × {len(runs)} | {spread([r['p50'] for r in runs])} | "
                  f"{spread([r['p99'] for r in runs])} | {spread([r['ttft'] for r in runs], '{:.3f}')} | "
                  f"{spread([r['per_token'] * 1000 if r['per_token'] else None for r in runs], '{:.1f}')} | "
                  f"{spread([r['tps'] for r in runs], '{:.1f}')} | "
                  f"{failed}{' (' + '; '.join(errs) + ')' if errs else ''} | {spread([r['other_cpu'] / r['wall'] for r in runs])} |")
                bsum[(c, name)] = {k: med([r[k] for r in runs]) for k in ("p50", "ttft", "tps", "per_token")}
        w("")
        table_head(w, "concurrency = slots", "tokens/s llamabox / llama-server", "TTFT p50 llamabox / llama-server",
                   "p50 latency llamabox / llama-server", "ms/token llamabox / llama-server")
        for c in levels:
            a, b = bsum.get((c, "llamabox")), bsum.get((c, "llama-server"))
            if a and b:
                w(f"| {c} | {ratio(a['tps'], b['tps'])} | {ratio(a['ttft'], b['ttft'])} | {ratio(a['p50'], b['p50'])} | "
                  f"{ratio(a['per_token'], b['per_token'])} |")
        w("")
        if results["batched_disconnect"]:
            w("Hang-ups at concurrency-4 batched servers (trials as in the hang-up section below: a ~1510-token "
              "prompt, the client closes 0.5 s after sending it). Close → idle from outside, median (min–max); prompt "
              "rows computed in the trial:")
            w("")
            table_head(w, "server", "trials", "close → idle s", "prompt rows computed")
            idle = {}
            for name in ("llamabox", "llama-server"):
                trials = [t for t in results["batched_disconnect"].get(name, []) if "error" not in t]
                if not trials:
                    continue
                idle[name] = med([t["close_to_idle"] for t in trials])
                w(f"| {name} | {len(trials)} | {spread([t['close_to_idle'] for t in trials], '{:.4f}')} | "
                  f"{spread([t['prompt_tokens'] for t in trials], '{:.0f}')} |")
            if len(idle) == 2 and idle["llamabox"]:
                w("")
                w(f"llama-server / llamabox close → idle: {idle['llama-server'] / idle['llamabox']:.0f}×.")
            w("")
        if results["batched_isolation"]:
            w("B beside A's hang-up at the batched concurrency-4 servers (B alone, then B while A hangs up mid-prefill "
              "beside it; greedy, 64 tokens):")
            w("")
            table_head(w, "server", "rounds", "B whole", "B's text as alone", "B's latency beside / alone",
                       "B's TTFT beside / alone")
            for name in ("llamabox", "llama-server"):
                rounds = results["batched_isolation"].get(name, [])
                if not rounds:
                    continue
                lat = med([r["together_latency"] / r["solo_latency"] for r in rounds if r["together_ok"] and r["solo_ok"]])
                ttft = med([r["together_ttft"] / r["solo_ttft"] for r in rounds if r["together_ttft"] and r["solo_ttft"]])
                w(f"| {name} | {len(rounds)} | {sum(r['together_ok'] for r in rounds)} | {sum(r['identical'] for r in rounds)} | "
                  f"{lat or 0:.2f}× | {ttft or 0:.2f}× |")
            w("")
        if results["batched_goodput"]:
            w(f"Goodput under hang-ups at the batched concurrency-4 servers ({args.goodput_seconds:.0f} s, 4 clients, 3 of "
              "every 10 requests hang up 0.3 s into a ~1510-token prefill):")
            w("")
            table_head(w, "server", "completed / minute", "failed", "late")
            for name in ("llamabox", "llama-server"):
                g = results["batched_goodput"].get(name)
                if g:
                    w(f"| {name} | {g['per_minute']:.1f} | {g['failed']} | {g['late']} |")
            w("")
        w("The unbatched tables below are the control: llamabox with `--batch false` (each request a context "
          "of its own, bit-for-bit answers) against llama-server at 1 and 2 slots.")
        w("")

    # ---- throughput
    w("## Chat completions: latency and throughput")
    w("")
    w("Latency: request sent → `[DONE]`. TTFT: request sent → first event with text. ms/token: (`[DONE]` − "
      "first text) / (tokens − 1), the generation pace one client sees. Tokens/s: completion tokens of all "
      "requests / wall time of the run. Prompt: prompt tokens per request as the servers report them "
      "(in parentheses, of which reused: llama-server's prompt cache, per its usage; llamabox's idle contexts, "
      "the run's mean per request from /metrics). Medians of the rounds (min–max); p50/p99 are "
      "over one run's requests (nearest rank: with 8 requests p99 is the slowest). Other load: CPU other "
      "processes used during the run, in cores (anything well above 0 disturbed it). The row marked *shared "
      "system* sends the same system message first in every request (the user message is unique), so "
      "llama-server's prompt cache skips recomputing it; every other row's requests are unique from their "
      "first message on.")
    w("")
    table_head(w, "concurrency", "slots", "server", "requests", "p50 s", "p99 s", "TTFT p50 s", "ms/token",
               "tokens/s", "prompt (cached)", "failed", "other load, cores")
    rows = [("1slot", 1, 1), ("1slot-shared", 1, 1), ("slots", 1, slots), ("slots", 4, slots), ("slots", 8, slots)]
    summary = {}
    for cfg, c, n_slots in rows:
        for name in ("llamabox", "llama-server"):
            runs = results["load"].get((cfg, c, name), [])
            if not runs:
                continue
            failed = sum(r["failed"] for r in runs)
            errs = sorted({e for r in runs for e in r["errors"]})
            prompt = med([r["prompt"] for r in runs])
            cached = med([r["cached"] for r in runs])
            prompt = "—" if prompt is None else f"{prompt:.0f}" + ("" if cached is None else f" ({cached:.0f})")
            w(f"| {c}{' *shared system*' if cfg.endswith('shared') else ''} | {n_slots} × {args.threads // n_slots} thr | "
              f"{name} | {runs[0]['n']} × {len(runs)} | "
              f"{spread([r['p50'] for r in runs])} | {spread([r['p99'] for r in runs])} | "
              f"{spread([r['ttft'] for r in runs], '{:.3f}')} | "
              f"{spread([r['per_token'] * 1000 if r['per_token'] else None for r in runs], '{:.1f}')} | "
              f"{spread([r['tps'] for r in runs], '{:.1f}')} | {prompt} | "
              f"{failed}{' (' + '; '.join(errs) + ')' if errs else ''} | {spread([r['other_cpu'] / r['wall'] for r in runs])} |")
            summary[(cfg, c, name)] = {k: med([r[k] for r in runs]) for k in ("p50", "p99", "ttft", "tps", "cpu", "per_token")}
    w("")
    table_head(w, "concurrency", "slots", "tokens/s llamabox / llama-server", "p50 latency llamabox / llama-server",
               "TTFT llamabox / llama-server", "ms/token llamabox / llama-server")
    for cfg, c, n_slots in rows:
        a, b = summary.get((cfg, c, "llamabox")), summary.get((cfg, c, "llama-server"))
        if a and b:
            w(f"| {c}{' *shared system*' if cfg.endswith('shared') else ''} | {n_slots} | {ratio(a['tps'], b['tps'])} | "
              f"{ratio(a['p50'], b['p50'])} | {ratio(a['ttft'], b['ttft'])} | {ratio(a['per_token'], b['per_token'])} |")
    w("")

    # ---- disconnects
    w("## Client hang-up → end of native work")
    w("")
    w(f"One request at a time on the {slots}-slot servers. Prefill: a unique ~1510-token prompt, the client "
      "closes its socket 0.5 s after sending it. Generation: a long story (max_tokens 400), the client closes "
      "after the 8th text event. Close → idle is measured from outside: llamabox until `/metrics` shows "
      "`llamabox_in_flight` and `llamabox_live_workers` at 0, llama-server until `GET /slots` shows no slot "
      "processing (it answers /slots and /metrics while a decode runs), polled every 5 ms. llamabox's own "
      "figure is its `llamabox_disconnect_stop_seconds` (the server noticing the close → native work "
      "stopped), mean per trial. Prompt rows computed: over the trial, llama-server's /metrics "
      "`llamacpp:prompt_tokens_total` (the prompt it computed although the client had gone), llamabox's "
      "`llamabox_tokens_decoded_total` (rows of llama.cpp batches it counted as decoded). Generated after the "
      "close: tokens generated in the trial less the text events the client had received (approximate: an "
      "event is a token here). Median (min–max) of the trials.")
    w("")
    table_head(w, "during", "server", "trials", "close → idle s", "server's own close → stop s",
               "prompt rows computed", "generated after the close", "note")
    dsum = {}
    for phase in ("prefill", "generation"):
        for name in ("llamabox", "llama-server"):
            trials = results["disconnect"].get((phase, name), [])
            good = [t for t in trials if "error" not in t]
            notes = [t["error"] for t in trials if "error" in t]
            own = "—"
            if name == "llamabox":
                own = spread([t.get("own_stop") for t in good], "{:.4f}")
                if not all(t.get("cancelled") for t in good):
                    notes.append("not every trial counted a disconnect cancel")
            prompt = spread([t.get("prompt_tokens") for t in good], "{:.0f}") if phase == "prefill" else "—"
            after = "—"
            if phase == "generation":
                after = spread([t["predicted"] - t["pieces_before_close"] for t in good if t.get("predicted") is not None], "{:.0f}")
            w(f"| {phase} | {name} | {len(trials)} | {spread([t.get('close_to_idle') for t in good], '{:.3f}')} | "
              f"{own} | {prompt} | {after} | {'; '.join(notes)} |")
            dsum[(phase, name)] = med([t.get("close_to_idle") for t in good])
    w("")
    for phase in ("prefill", "generation"):
        a, b = dsum.get((phase, "llamabox")), dsum.get((phase, "llama-server"))
        if a and b:
            w(f"- {phase}: llama-server took {b / a:.0f}× as long as llamabox to go idle after the hang-up "
              f"({b:.3f} s vs {a:.3f} s).")
    w("")

    # ---- isolation
    w("## A hang-up beside a normal request (concurrency 2)")
    w("")
    w("Client B asks a fixed question (max_tokens 64) alone, then again while client A, sent 0.1 s before it, "
      "hangs up 0.5 s into a unique ~1510-token prefill. Identical: B's text beside A equals its solo text "
      "(greedy). To keep llama-server's prompt cache from serving B's repeat, its B requests carry "
      "`cache_prompt: false`. Medians (min–max) of the rounds.")
    w("")
    table_head(w, "server", "rounds", "B whole and identical", "B latency alone s", "B latency beside A s", "change",
               "B TTFT alone s", "B TTFT beside A s")
    isum = {}
    for name in ("llamabox", "llama-server"):
        rs = results["isolation"].get(name, [])
        if not rs:
            continue
        same = sum(1 for r in rs if r["identical"])
        alone, beside = med([r["solo_latency"] for r in rs]), med([r["together_latency"] for r in rs])
        isum[name] = (same == len(rs), beside / alone - 1 if alone else None)
        w(f"| {name} | {len(rs)} | {same} of {len(rs)} | {spread([r['solo_latency'] for r in rs])} | "
          f"{spread([r['together_latency'] for r in rs])} | {(beside / alone - 1) * 100:+.0f}% | "
          f"{spread([r['solo_ttft'] for r in rs], '{:.3f}')} | {spread([r['together_ttft'] for r in rs], '{:.3f}')} |")
    w("")

    # ---- goodput
    w(f"## Goodput under hang-ups ({args.goodput_seconds:.0f} s, concurrency 4)")
    w("")
    w(f"Four clients send requests back to back for {args.goodput_seconds:.0f} s; requests 3, 6 and 9 of every "
      f"10 (30%) send a unique ~1510-token prompt and hang up 0.3 s after sending it, the rest are normal "
      f"chats (max_tokens {args.max_tokens}). A client whose request failed waits 0.1 s before its next one. "
      "Completed: normal chats answered whole within the window. CPU: "
      "the server process's CPU time from the window's start until its last request ended (wall: that time).")
    w("")
    table_head(w, "server", "requests sent", "hung up", "completed", "completed / minute",
               "finished after the window", "failed (first at s)", "p50 latency of completed s", "CPU s / wall s",
               "other load, cores", "queue depth once idle")
    for name in ("llamabox", "llama-server"):
        g = results["goodput"].get(name)
        if not g:
            continue
        fails = f"{g['failed']}"
        if g["failed"]:
            fails += f" (first at {g.get('first_failure', 0):.1f} s: {'; '.join(e[:120] for e in g['errors'])})"
        p50 = f"{pct(g['latencies'], 50):.2f}" if g["latencies"] else "—"
        queue = f"{g['queue_after']:.0f}" if "queue_after" in g else "—"
        w(f"| {name} | {g['sent']} | {g['hung_up']} | {g['completed']} | {g['per_minute']:.1f} | {g['late']} | "
          f"{fails} | {p50} | {g['cpu']:.1f} / {g['wall']:.1f} | {g['other_cpu'] / g['wall']:.2f} | {queue} |")
    ga, gb = results["goodput"].get("llamabox"), results["goodput"].get("llama-server")
    w("")
    if ga and gb:
        w(f"llamabox / llama-server completed per minute: {ratio(ga['per_minute'], gb['per_minute'])}")
        w("")

    # ---- targets
    w("## Targets")
    w("")
    a, b = summary.get(("1slot", 1, "llamabox")), summary.get(("1slot", 1, "llama-server"))
    if a and b:
        d = a["tps"] / b["tps"] - 1
        w(f"- Throughput at concurrency 1 within 10% of llama-server: {'met' if d >= -0.10 else 'missed'} "
          f"({d * 100:+.1f}%: {a['tps']:.1f} vs {b['tps']:.1f} tokens/s).")
    a, b = dsum.get(("prefill", "llamabox")), dsum.get(("prefill", "llama-server"))
    if a and b:
        w(f"- A hang-up during prefill stops ≥ 10× sooner than llama-server: {'met' if b / a >= 10 else 'missed'} "
          f"({b / a:.0f}×: {a:.3f} s vs {b:.3f} s).")
    if ga and gb:
        w(f"- Goodput under hang-ups ahead of llama-server: {'met' if ga['per_minute'] > gb['per_minute'] else 'missed'} "
          f"({ga['per_minute']:.1f} vs {gb['per_minute']:.1f} completed per minute).")
    if "llamabox" in isum:
        whole = isum["llamabox"][0] and (not ga or ga["failed"] == 0)
        w(f"- A hang-up never touches another request (llamabox): {'met' if whole else 'missed'} "
          f"(B identical and whole in every round: {'yes' if isum['llamabox'][0] else 'no'}; "
          f"its latency beside the hang-up {isum['llamabox'][1] * 100:+.0f}%; failed normal requests in the "
          f"goodput window: {ga['failed'] if ga else '—'}).")
    if "llama-server" in isum:
        w(f"- (llama-server, same check: B identical in every round: {'yes' if isum['llama-server'][0] else 'no'}; "
          f"latency beside the hang-up {isum['llama-server'][1] * 100:+.0f}%.)")
    w("")
    return "\n".join(L)


if __name__ == "__main__":
    main()
