#!/usr/bin/env python3
"""Drives the openai plugin's chat page in headless Chromium (Debian's
chromium-headless-shell) over the DevTools protocol: sends a prompt, presses Stop
after some tokens have arrived, and reads the page's report of what the server
computed after Stop. Then, in the same page, it checks that the page recovers from a
failed request: a message over the model's context is answered with the server's
error, shown in the conversation, and a short message typed and sent with Enter is
answered in full (the failed one is not sent again with it), the input cleared and the
conversation scrolled to its end. Prints the Stop report, with the recovery's findings
under "recovery", as JSON; exits non-zero if the page did not recover.

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
# Far over the plugin's context (4096 tokens by default, at most the model's 8192).
TOO_LONG = "llama " * 5000
# A question the model answers briefly, in full, with no max_tokens.
SHORT = "Say hello in one word."
# Time for that whole answer on a busy CPU.
ANSWER_TIMEOUT_S = 180


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

    def wait_for(self, expression, what, timeout_s=TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.02)
        raise TimeoutError(f"timed out waiting for {what}")

    def press_enter(self):
        """Enter, as a keyboard sends it to the focused element."""
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13,
                      **({"text": "\r"} if kind == "keyDown" else {}))


def recover(page):
    """After Stop: a failed request, then a message sent with Enter. Returns what was seen."""
    turns = "document.querySelectorAll('#log .turn')"
    # An over-long message, pasted and sent with Enter: the server refuses it.
    page.eval("document.getElementById('prompt').focus()")
    page.call("Input.insertText", text=TOO_LONG)
    page.press_enter()
    error = page.wait_for("document.querySelector('#log .error')?.textContent", "the error of the over-long message")
    page.wait_for("document.getElementById('send').disabled === false", "the page to be ready again")
    # A short message, typed and sent with Enter.
    page.call("Input.insertText", text=SHORT)
    typed = page.eval("document.getElementById('prompt').value")
    page.press_enter()
    # Sending clears the input at once and shows the question (the answer may be done already).
    cleared = page.wait_for(f"document.getElementById('prompt').value === '' && [...{turns}].some("
                            f"(t) => t.classList.contains('user') && t.textContent === {json.dumps(SHORT)})",
                            "the message to be sent and the input cleared")
    page.wait_for("document.getElementById('send').disabled === false", "the short answer", ANSWER_TIMEOUT_S)
    seen = page.eval(f"""(() => {{
        const log = document.getElementById('log');
        const all = [...{turns}];
        const last = all[all.length - 1];
        return {{
            status: document.getElementById('status').textContent,
            errors: all.filter((t) => t.classList.contains('error')).length,
            question: all.length >= 2 ? all[all.length - 2].textContent : null,
            answer: last && last.classList.contains('assistant') ? last.textContent : null,
            input: document.getElementById('prompt').value,
            overflows: log.scrollHeight > log.clientHeight,
            atEnd: log.scrollHeight - log.scrollTop - log.clientHeight <= 2,
            sent: conversation.map((m) => m.role + ':' + m.content.length),
            resentFailed: conversation.some((m) => m.content.startsWith('llama llama')),
        }};
    }})()""")
    seen.update(error=error, typed=typed, cleared=bool(cleared))
    seen["recovered"] = (
        "context" in error and typed == SHORT and seen["errors"] == 1 and seen["question"] == SHORT
        and seen["status"].startswith("done:") and bool(seen["answer"] and seen["answer"].strip())
        and seen["input"] == "" and seen["overflows"] and seen["atEnd"] and not seen["resentFailed"]
        and len(seen["sent"]) == 4)
    return seen


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
        report["recovery"] = recover(page)
        print(json.dumps(report))
        if not report["recovery"]["recovered"]:
            sys.exit(f"FAIL: the page did not recover from a failed request: {json.dumps(report['recovery'])}")
    finally:
        try:
            os.killpg(chromium.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        chromium.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
