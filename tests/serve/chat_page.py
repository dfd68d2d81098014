#!/usr/bin/env python3
"""Drives the openai plugin's chat page in headless Chromium (Debian's
chromium-headless-shell) over the DevTools protocol: sends a prompt, presses Stop
after some tokens have arrived, and prints the page's report of what the server
computed after Stop, as JSON.

Usage: python3 tests/serve/chat_page.py URL [SCREENSHOT.png]
       (URL: the page, like http://127.0.0.1:PORT/; needs `pip install websocket-client`)
"""

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

# Stop once this many tokens have reached the page.
STOP_AFTER_TOKENS = 8
TIMEOUT_S = 60


def browser():
    for name in ("chromium-headless-shell", "chromium"):
        if path := shutil.which(name):
            return path
    sys.exit("FAIL: no headless Chromium (apt-get install chromium-headless-shell)")


class Page:
    """One tab, spoken to over its DevTools websocket."""

    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=TIMEOUT_S)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def eval(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, what):
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.02)
        raise TimeoutError(f"timed out waiting for {what}")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    url, screenshot = sys.argv[1], (sys.argv[2] if len(sys.argv) == 3 else None)
    profile = tempfile.mkdtemp(prefix="llamabox-chromium-")
    chromium = subprocess.Popen(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", "--window-size=900,760", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # A group of its own: the command may be a wrapper script whose browser, zygote
        # and renderers outlive a kill of the script alone; the group is killed whole.
        start_new_session=True)
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if time.monotonic() > deadline or chromium.poll() is not None:
                sys.exit("FAIL: Chromium did not start its DevTools server")
            time.sleep(0.05)
        port = open(port_file).read().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        page.call("Page.enable")
        page.call("Page.navigate", url=url)
        page.wait_for("document.readyState === 'complete' && document.querySelector('#model').options.length > 0", "the page and its models")
        page.eval("document.getElementById('send').click()")
        page.wait_for(f"shown.tokens >= {STOP_AFTER_TOKENS}", f"{STOP_AFTER_TOKENS} tokens")
        page.eval("document.getElementById('stop').click()")
        page.wait_for("document.getElementById('status').dataset.afterStop !== undefined", "the report after Stop")
        report = page.eval("({...document.getElementById('status').dataset, text: document.getElementById('status').textContent,"
                           " answer: document.querySelector('.assistant').textContent})")
        if screenshot:
            shot = page.call("Page.captureScreenshot", format="png")
            with open(screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
        print(json.dumps(report))
    finally:
        try:
            os.killpg(chromium.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        chromium.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
