#!/usr/bin/env python3
"""Tenants under load (issue 34): weights, and what one tenant can learn of another's
prompt. `make bench-tenants` runs it against the release build with SmolLM2; it starts
its own `llamabox serve` on loopback and stops it by its PID, whatever happens.

- Weights: two tenants with weights 1 and 3 each keep CLIENTS chats in flight (closed
  loop) for SECONDS; the completion tokens each got, and their shares (target 25% / 75%).
- Isolation: tenant A sends a system prompt; tenant B then sends (a) exactly A's prompt
  and (b) a prompt of the same shape nobody sent, ROUNDS times each, alternating; then
  A sends its own prompt again (what a hit looks like). Reported: cached_tokens and the
  time to the answer (max_tokens 1). B's two rows must not differ: nothing of A's is
  kept for B. (B's small cached_tokens are its own: the chat template's first tokens,
  and the start its last probe shared.)

Every figure is printed with the CPU's name and the server's threads; it writes
bench/TENANTS.md.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_bench import stop_process  # noqa: E402

KEYS = {"light": "sk-bench-light-0123456789", "heavy": "sk-bench-heavy-0123456789"}


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def chat(port, key, system, user, max_tokens):
    body = json.dumps({
        "model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    started = time.monotonic()
    c.request("POST", "/v1/chat/completions", body,
              {"content-type": "application/json", "authorization": f"Bearer {key}"})
    r = c.getresponse()
    data = r.read()
    elapsed = time.monotonic() - started
    c.close()
    if r.status != 200:
        return r.status, None, elapsed
    return 200, json.loads(data)["usage"], elapsed


def tenants_config(plugin, model, threads):
    return (f'listen = "127.0.0.1:0"\nthreads = {threads}\nqueue_timeout_ms = 60000\n'
            f'max_queue = 256\n[models]\nsmollm2 = "{model}"\n'
            f'[[plugins]]\nname = "openai"\npath = "{plugin}"\n'
            f'[[tenants]]\nname = "light"\nkey = "{KEYS["light"]}"\nweight = 1\nmax_queued = 64\n'
            f'[[tenants]]\nname = "heavy"\nkey = "{KEYS["heavy"]}"\nweight = 3\nmax_queued = 64\n')


class Server:
    """`llamabox serve --config` with `config` (serve.toml's text) in `workdir`, stopped by
    its PID (`stop`); `name` names its files."""

    def __init__(self, binary, config, workdir, name="serve"):
        self.config = os.path.join(workdir, f"{name}.toml")
        with open(self.config, "w") as f:
            f.write(config)
        self.log = os.path.join(workdir, f"{name}.log")
        self.proc = subprocess.Popen([binary, "serve", "--config", self.config],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = open(self.log).read()
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
            if m and "\nready" in text:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(text[-2000:])
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def stop(self):
        stop_process(self.proc)


def serve_arguments(**defaults):
    """The command line of a bench that starts `llamabox serve`: the binary, the openai
    plugin and the model, then the bench's own options (`defaults`: name -> default,
    typed by the default)."""
    p = argparse.ArgumentParser()
    for name in ("llamabox", "plugin", "model"):
        p.add_argument(f"--{name}", required=True)
    for name, default in defaults.items():
        p.add_argument(f"--{name}", type=type(default), default=default)
    return p.parse_args()


def weights(server, clients, seconds):
    tokens = {"light": 0, "heavy": 0}
    refused = {"light": 0, "heavy": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(tenant, n):
        i = 0
        while time.monotonic() < stop_at:
            status, usage, _ = chat(server.port, KEYS[tenant], "You are brief.",
                                    f"{tenant} {n} {i}: tell me about llamas.", 32)
            with lock:
                if status == 200 and time.monotonic() <= stop_at:
                    tokens[tenant] += usage["completion_tokens"]
                elif status != 200:
                    refused[tenant] += 1
            i += 1

    threads = [threading.Thread(target=client, args=(t, n)) for t in KEYS for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens, refused


def isolation(server, rounds):
    """B probes A's prompt, and one nobody sent, each new every round and alike in
    length and shape; each starts with its own word, so B's own leftovers share only
    the chat template's first tokens with either, and the order alternates."""
    seen = {"sent by another tenant": [], "sent by nobody": [], "A's own, sent again by A (a hit)": []}
    for i in range(rounds):
        secret = f"Alpha {i}: the code is {482913 + i}. Never tell anyone the code."
        nobody = f"Bravo {i}: the code is {771204 + i}. Never tell anyone the code."
        status, _, _ = chat(server.port, KEYS["light"], secret, "Hello.", 1)
        assert status == 200, status
        probes = [("sent by another tenant", secret), ("sent by nobody", nobody)]
        for label, system in probes if i % 2 == 0 else probes[::-1]:
            status, usage, elapsed = chat(server.port, KEYS["heavy"], system, "Hello.", 1)
            assert status == 200, status
            seen[label].append((usage["prompt_tokens_details"]["cached_tokens"], elapsed))
        # What a hit looks like, for scale: A's prompt again, by A.
        status, usage, elapsed = chat(server.port, KEYS["light"], secret, "Hello.", 1)
        assert status == 200, status
        seen["A's own, sent again by A (a hit)"].append((usage["prompt_tokens_details"]["cached_tokens"], elapsed))
    return seen


def main():
    args = serve_arguments(clients=8, seconds=60, rounds=10, out="bench/TENANTS.md")
    ncpu = os.cpu_count()
    lines = [f"# Tenants under load\n",
             f"`make bench-tenants` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): "
             f"{cpu_name()}, {ncpu} cores; SmolLM2-135M Q4_1; llamabox at its defaults but for "
             "its tenants, a 60 s queue timeout and a 256-place queue (so that nobody is "
             "refused and the shares are the scheduler's alone).\n"]
    for threads in sorted({1, ncpu}):
        with tempfile.TemporaryDirectory() as workdir:
            server = Server(args.llamabox, tenants_config(args.plugin, args.model, threads), workdir)
            try:
                tokens, refused = weights(server, args.clients, args.seconds)
                seen = isolation(server, args.rounds)
            finally:
                server.stop()
        total = sum(tokens.values()) or 1
        lines.append(f"\n## {threads} thread{'s' if threads > 1 else ''}\n")
        lines.append(f"Weights 1 and 3, {args.clients} clients each, closed loop, {args.seconds} s "
                     "(completion tokens; target 25% / 75% ± 10%):\n")
        lines.append("| tenant | weight | tokens | share | refused |\n|---|---|---|---|---|")
        for tenant, weight in (("light", 1), ("heavy", 3)):
            lines.append(f"| {tenant} | {weight} | {tokens[tenant]} | {100 * tokens[tenant] / total:.1f}% "
                         f"| {refused[tenant]} |")
        lines.append(f"\nIsolation, {args.rounds} probes each by tenant B (cached_tokens; time to "
                     "a 1-token answer, ms):\n")
        lines.append("| prompt | cached_tokens (every value seen) | time p50 | time min–max |\n|---|---|---|---|")
        for label, values in seen.items():
            cached = sorted({c for c, _ in values})
            ms = [1000 * t for _, t in values]
            lines.append(f"| {label} | {cached} | {statistics.median(ms):.0f} | "
                         f"{min(ms):.0f}–{max(ms):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
