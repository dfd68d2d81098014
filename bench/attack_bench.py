#!/usr/bin/env python3
"""Fairness under attack (issue 34): a well-behaved tenant streams chats while another
tenant, from several loopback addresses, attacks. `make bench-attacks` runs it against
the release build with SmolLM2, at 1 thread and at all cores; it starts its own
`llamabox serve` (defaults, but for two keyed tenants) on loopback and stops it by its
PID, whatever happens. Writes bench/ATTACKS.md.

The victim sends one streamed greedy chat after another (`max_tokens` 32, unique text)
for WINDOW seconds: alone first, then beside each attack. Reported per attack: the
victim's TTFT and inter-token gap (ITL) at p50 and p99, as ratios to its solo run, and
every refusal either tenant got. The issue's targets: victim ITL p99 ≤ 2× solo and ≤ the
step target (250 ms) + one step, TTFT p99 ≤ 1.5× solo, no 429 or 503 for the victim.

Attacks (each from 4 addresses, 127.0.0.2-5, with the attacker's key, closed loop):
- long-prompts: unique ~1500-token prompts, max_tokens 1;
- hangup-prefill: the same prompts, the connection closed 0.3 s after sending;
- hangup-first-token: normal chats, closed at the first piece;
- embeddings: /v1/embeddings of one ~2000-token input (2 clients);
- n4-grammar: chats with n=4 and a JSON schema;
- unread-streams: streamed chats of 256 tokens never read, dropped after 10 s.
Image chats are not in this run (they need a vision projector the bench does not load).
"""

import http.client
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_bench import pct as nearest_rank, write_keeping_notes  # noqa: E402
from tenant_bench import Server, cpu_name, serve_arguments  # noqa: E402

KEYS = {"victim": "sk-bench-victim-0123456789", "attacker": "sk-bench-attacker-0123456789"}
WORDS = ("river stone light cloud paper garden window music forest silver harbor winter "
         "candle meadow bridge lantern valley orchard thunder velvet").split()
ATTACKER_ADDRESSES = [f"127.0.0.{i}" for i in range(2, 6)]


def pct(values, q):
    """server_bench's percentile, or None for no values (a row where the victim got none)."""
    return nearest_rank(values, q) if values else None


def long_text(tag, words):
    r = random.Random(tag)
    return f"{tag}: " + " ".join(r.choice(WORDS) for _ in range(words))


def attack_config(plugin, model, threads):
    return (f'listen = "127.0.0.1:0"\nthreads = {threads}\n[models]\nsmollm2 = "{model}"\n'
            f'[[plugins]]\nname = "openai"\npath = "{plugin}"\n'
            f'[[tenants]]\nname = "victim"\nkey = "{KEYS["victim"]}"\n'
            f'[[tenants]]\nname = "attacker"\nkey = "{KEYS["attacker"]}"\n')


def post(port, path, key, body, source=None, stream=False, close_after=None, close_at_first=False,
         never_read=None):
    """POST `body`; returns (status, piece times, t_send). With stream, reads the events and
    records when each content piece came; close_after: hang up that many seconds after
    sending; close_at_first: hang up at the first piece; never_read: hold the response
    unread for that many seconds, then drop it."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=180,
                                   source_address=(source, 0) if source else None)
    t_send = time.monotonic()
    pieces = []
    try:
        c.connect()
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if close_after is not None:
            c.sock.settimeout(close_after)
        c.request("POST", path, json.dumps(body),
                  {"content-type": "application/json", "authorization": f"Bearer {KEYS[key]}"})
        r = c.getresponse()
        if never_read is not None:
            time.sleep(never_read)
            return r.status, pieces, t_send
        if r.status != 200 or not stream:
            r.read()
            return r.status, pieces, t_send
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            value = line[5:].strip()
            if value == b"[DONE]":
                break
            obj = json.loads(value)
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    pieces.append(time.monotonic())
                    if close_at_first:
                        return 200, pieces, t_send
        return 200, pieces, t_send
    except (socket.timeout, TimeoutError):
        return "hung up", pieces, t_send
    except OSError as e:
        return f"{type(e).__name__}", pieces, t_send
    finally:
        c.close()


def chat_body(text, max_tokens, stream=True, **extra):
    return {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": text}],
            **extra}


SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


def attack(name, port, source, n):
    """One request of attack `name` by client `n`; returns its status."""
    tag = f"{name}-{source}-{n}-{time.monotonic_ns()}"
    if name == "long-prompts":
        return post(port, "/v1/chat/completions", "attacker", chat_body(long_text(tag, 1500), 1, stream=False),
                    source)[0]
    if name == "hangup-prefill":
        return post(port, "/v1/chat/completions", "attacker", chat_body(long_text(tag, 1500), 32), source,
                    stream=True, close_after=0.3)[0]
    if name == "hangup-first-token":
        return post(port, "/v1/chat/completions", "attacker", chat_body(f"{tag}: tell me about llamas.", 64),
                    source, stream=True, close_at_first=True)[0]
    if name == "embeddings":
        return post(port, "/v1/embeddings", "attacker", {"model": "smollm2", "input": long_text(tag, 2000)},
                    source)[0]
    if name == "n4-grammar":
        return post(port, "/v1/chat/completions", "attacker",
                    chat_body(f"{tag}: describe a pet as JSON.", 32, stream=False, n=4, response_format=SCHEMA),
                    source)[0]
    if name == "unread-streams":
        return post(port, "/v1/chat/completions", "attacker", chat_body(f"{tag}: write a long story.", 256),
                    source, stream=True, never_read=10)[0]
    raise ValueError(name)


ATTACKS = ["long-prompts", "hangup-prefill", "hangup-first-token", "embeddings", "n4-grammar", "unread-streams"]


def window(port, seconds, tag, attack_name=None, think=0.0):
    """The victim's chats for `seconds`, beside `attack_name` if any, `think` seconds
    between one chat's end and the next. Every chat's text is unique (window `tag`, chat
    number) and as long in tokens as in every other window: the solo run is the yardstick
    of each attack's row, so its prompts must cost what theirs do."""
    stop_at = time.monotonic() + seconds
    statuses = {"victim": {}, "attacker": {}}
    lock = threading.Lock()

    def count(who, status):
        with lock:
            statuses[who][status] = statuses[who].get(status, 0) + 1

    def attacker(source, n):
        while time.monotonic() < stop_at:
            count("attacker", attack(attack_name, port, source, n))

    clients = []
    if attack_name:
        addresses = ATTACKER_ADDRESSES[:2] if attack_name == "embeddings" else ATTACKER_ADDRESSES
        clients = [threading.Thread(target=attacker, args=(a, n)) for n, a in enumerate(addresses)]
        for t in clients:
            t.start()
        time.sleep(2)  # the attack under way before the victim starts
    ttft, itl = [], []
    i = 0
    while time.monotonic() < stop_at:
        status, pieces, t_send = post(port, "/v1/chat/completions", "victim",
                                      chat_body(f"Victim {tag:02d}-{i:04d}: tell me about llamas.", 32), stream=True)
        count("victim", status)
        if status == 200 and pieces:
            ttft.append(pieces[0] - t_send)
            itl.extend(b - a for a, b in zip(pieces, pieces[1:]))
        i += 1
        time.sleep(min(think, max(0.0, stop_at - time.monotonic())))
    for t in clients:
        t.join()
    return {"ttft": ttft, "itl": itl, "statuses": statuses}


def main():
    args = serve_arguments(window=30.0, threads=f"1,{os.cpu_count()}", attacks=",".join(ATTACKS),
                           out="bench/ATTACKS.md", think=0.0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.monotonic()
    lines = ["# Fairness under attack", "",
             f"`make bench-attacks` ({started}): {cpu_name()}, {os.cpu_count()} cores; SmolLM2-135M Q4_1; "
             f"`llamabox serve` at its defaults but for two keyed tenants (victim, attacker). The victim streams one "
             f"chat after another (32 tokens{f', {args.think:g} s between them' if args.think else ''}) "
             f"for {args.window:.0f} s per row; the attacker runs from 4 loopback "
             "addresses (embeddings: 2). Times in ms; ratios against the victim alone in the same server. Targets: "
             "ITL p99 ≤ 2× solo and ≤ 250 ms + one step, TTFT p99 ≤ 1.5× solo, no refusal of the victim.", ""]
    workdir = tempfile.mkdtemp(prefix="llamabox-attack-bench.")
    for threads in sorted({int(t) for t in args.threads.split(",") if t}):
        server = Server(args.llamabox, attack_config(args.plugin, args.model, threads), workdir,
                        f"serve-{threads}")
        try:
            window(server.port, 5, 0)  # warm up
            solo = window(server.port, args.window, 1, think=args.think)
            rows = [("alone", solo)]
            for tag, name in enumerate([a for a in args.attacks.split(",") if a], start=2):
                print(f"{threads} thread(s): {name}", flush=True)
                rows.append((name, window(server.port, args.window, tag, name, args.think)))
                time.sleep(3)
        finally:
            server.stop()
        s_ttft, s_itl = pct(solo["ttft"], 99), pct(solo["itl"], 99)
        lines += [f"## {threads} thread(s)", "",
                  "| attack | victim chats | TTFT p50 | TTFT p99 | × solo | ITL p50 | ITL p99 | × solo | targets | "
                  "victim refused | attacker's statuses |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows:
            t99, i99 = pct(r["ttft"], 99), pct(r["itl"], 99)
            refused = {k: v for k, v in r["statuses"]["victim"].items() if k != 200}
            met = (t99 is not None and i99 is not None and t99 <= 1.5 * s_ttft and i99 <= 2 * s_itl
                   and not refused) if name != "alone" else None
            fmt = (lambda v: f"{v * 1e3:.0f}" if v is not None else "–")
            lines.append(
                f"| {name} | {len(r['ttft'])} | {fmt(pct(r['ttft'], 50))} | {fmt(t99)} | "
                f"{(t99 / s_ttft) if t99 and s_ttft else 0:.2f}× | {fmt(pct(r['itl'], 50))} | {fmt(i99)} | "
                f"{(i99 / s_itl) if i99 and s_itl else 0:.2f}× | {'–' if met is None else ('met' if met else '**not met**')} | "
                f"{refused or 'none'} | {r['statuses']['attacker'] or '–'} |")
        lines.append("")
    lines.append(f"Run time {(time.monotonic() - t0) / 60:.1f} minutes; server logs in {workdir}.")
    write_keeping_notes(args.out, "\n".join(lines) + "\n", "bench-attacks")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
