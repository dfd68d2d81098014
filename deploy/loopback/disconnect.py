"""Client disconnect -> worker return, as seen from the replicas (scripts/scale-test.sh).

Each trial sends a streaming chat completion to URL (a replica, or a balancer in front
of some), reads until the first server-sent event arrives, closes its socket, and then
polls every replica's /metrics until the request is gone: llamabox_in_flight and
llamabox_live_workers back to where they were before the trial (the worker thread that
ran the generation has returned). It reports, per trial, the time from close() to that
point, and whether llamabox_cancels_total{cause="disconnect"} went up (a generation that
ran to its end instead was not cancelled). If the replicas export a histogram whose name
mentions "disconnect" (the server's own close -> cancel latency), its mean over the trial
is reported too.

With --no-stream the request asks for one JSON answer at the end, and the client closes
--close-after-ms after sending it (the generation is running, nothing has been answered
yet): the case where a balancer has nothing to write to the client, so only its watch on
the client's connection can notice the close.

Prints one JSON object per trial, then one with the medians. Loopback addresses only.

Usage: python3 disconnect.py --url http://127.0.0.1:PORT --metrics http://127.0.0.1:A,http://127.0.0.1:B
       [--trials 3] [--max-tokens 400] [--model smollm2] [--rst] [--no-stream --close-after-ms 300]
"""

import argparse
import http.client
import json
import socket
import statistics
import struct
import sys
import time
import urllib.parse


def loopback(url):
    host = urllib.parse.urlsplit(url).hostname
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        sys.exit(f"{url}: loopback addresses only")
    return url


class Getter:
    """GETs on one keep-alive connection, reconnecting (up to `tries` times) when the
    server closed it. bench/server_bench.py uses it too."""

    def __init__(self, host, port, timeout=5, tries=2):
        self.host, self.port, self.timeout, self.tries = host, port, timeout, tries
        self.conn = None

    def get(self, path):
        for _ in range(self.tries):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                self.conn.request("GET", path)
                response = self.conn.getresponse()
                return response.status, response.read().decode()
            except (OSError, http.client.HTTPException):
                self.conn = None
        raise RuntimeError(f"GET {path} on {self.host}:{self.port} failed")


class Metrics:
    """A replica's /metrics, parsed."""

    def __init__(self, base):
        u = urllib.parse.urlsplit(base)
        self.getter = Getter(u.hostname, u.port)

    def read(self):
        return parse(self.getter.get("/metrics")[1])


def parse(text):
    """Prometheus text format -> {'name{labels}': value} (labels as written).
    bench/server_bench.py uses it too."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key.strip()] = float(value)
        except ValueError:
            pass
    return samples


def total(samples, name, label=None):
    """Sum of every sample of NAME (optionally only those whose labels contain LABEL)."""
    out = 0.0
    for key, value in samples.items():
        metric = key.split("{", 1)[0]
        if metric == name and (label is None or label in key):
            out += value
    return out


def disconnect_histogram(samples):
    """(sum, count) of the first *_sum/_count pair whose name mentions disconnect."""
    for key in samples:
        metric = key.split("{", 1)[0]
        if "disconnect" in metric and metric.endswith("_sum"):
            base = metric[: -len("_sum")]
            return total(samples, base + "_sum"), total(samples, base + "_count")
    return None


def snapshot(replicas):
    merged = {"in_flight": 0.0, "live_workers": 0.0, "disconnects": 0.0, "hist": None}
    hist_sum = hist_count = 0.0
    have_hist = False
    for r in replicas:
        s = r.read()
        merged["in_flight"] += total(s, "llamabox_in_flight")
        merged["live_workers"] += total(s, "llamabox_live_workers")
        merged["disconnects"] += total(s, "llamabox_cancels_total", 'cause="disconnect"')
        h = disconnect_histogram(s)
        if h:
            have_hist = True
            hist_sum += h[0]
            hist_count += h[1]
    if have_hist:
        merged["hist"] = (hist_sum, hist_count)
    return merged


def trial(args, replicas):
    before = snapshot(replicas)
    u = urllib.parse.urlsplit(args.url)
    body = json.dumps({
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me a long story about a llama who learns to sail."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": not args.no_stream,
    }).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode() + body
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    started = time.monotonic()
    sock.sendall(request)
    received = b""
    if args.no_stream:
        time.sleep(args.close_after_ms / 1000)
        sock.setblocking(False)
        try:
            received = sock.recv(65536)
        except BlockingIOError:
            pass
        if received:
            raise RuntimeError(f"answered within --close-after-ms: {received[:300]!r}")
        status = "(not answered yet)"
    else:
        while b"data:" not in received.partition(b"\r\n\r\n")[2]:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"connection closed before the first event: {received[:300]!r}")
            received += chunk
        status = received.split(b"\r\n", 1)[0].decode(errors="replace")
    first_bytes = time.monotonic()
    if args.rst:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    closed = time.monotonic()

    # Wait for the worker to be back; then, if no disconnect was counted yet, 50 ms more
    # for the counter (a run that ended by itself, uncancelled, never counts one).
    deadline = closed + args.timeout
    after = None
    returned = None
    while time.monotonic() < deadline:
        after = snapshot(replicas)
        now = time.monotonic()
        if after["in_flight"] <= before["in_flight"] and after["live_workers"] <= before["live_workers"]:
            returned = returned or now
            if after["disconnects"] > before["disconnects"] or now - returned > 0.05:
                break
        else:
            returned = None
        time.sleep(0.002)
    returned = returned or time.monotonic()
    result = {
        "url": args.url,
        "status": status,
        "first_event_ms" if not args.no_stream else "closed_after_ms": round((first_bytes - started) * 1000, 1),
        "close_to_return_ms": round((returned - closed) * 1000, 1),
        "cancelled_by_disconnect": after is not None and after["disconnects"] > before["disconnects"],
        "returned": after is not None and after["in_flight"] <= before["in_flight"]
        and after["live_workers"] <= before["live_workers"],
    }
    if after is not None and after["hist"] and before["hist"]:
        d_sum = after["hist"][0] - before["hist"][0]
        d_count = after["hist"][1] - before["hist"][1]
        if d_count > 0:
            result["server_disconnect_latency_ms"] = round(d_sum / d_count * 1000, 2)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--metrics", required=True, help="comma-separated replica base URLs")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the worker to return")
    p.add_argument("--rst", action="store_true", help="close with a TCP reset instead of a FIN")
    p.add_argument("--no-stream", action="store_true", help="ask for one answer at the end; close before it")
    p.add_argument("--close-after-ms", type=float, default=300.0, help="with --no-stream: when to close")
    args = p.parse_args()
    loopback(args.url)
    replicas = [Metrics(loopback(m)) for m in args.metrics.split(",")]
    results = []
    for _ in range(args.trials):
        r = trial(args, replicas)
        results.append(r)
        print(json.dumps(r), flush=True)
        time.sleep(0.2)
    summary = {
        "url": args.url,
        "trials": len(results),
        "cancelled": sum(r["cancelled_by_disconnect"] for r in results),
        "median_close_to_return_ms": round(statistics.median(r["close_to_return_ms"] for r in results), 1),
        "max_close_to_return_ms": max(r["close_to_return_ms"] for r in results),
    }
    server = [r["server_disconnect_latency_ms"] for r in results if "server_disconnect_latency_ms" in r]
    if server:
        summary["median_server_disconnect_latency_ms"] = round(statistics.median(server), 2)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
