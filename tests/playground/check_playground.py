"""Drives the playground page of a running `prism serve` in a real headless Chromium, through WebDriver.

Run by crates/prism-cli/tests/serve_playground.rs: python3 check_playground.py BASE_URL SCREENSHOT.png
(Debian's `chromium` and `chromium-driver`; nothing is downloaded). A minimal W3C WebDriver client over
urllib, so no Python package is needed.

It loads the page, fills the evidence and one question of each type (the page's own buttons and inputs),
sends, waits for the answer and reads back every rendered probability (the bars' data-p), then sends the
exact request the page shows as curl straight to the API: the page must show the API's numbers. It then
checks labels on every control, the page at 400 px wide, and that an invalid request shows the field it
names, and writes a screenshot of the answered page. Prints one JSON object; any failed check raises.
"""

import base64
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    def __init__(self, chromedriver: str, chromium: str):
        self.port = free_port()
        self.process = subprocess.Popen(
            [chromedriver, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while True:
            try:
                self.call("GET", "/status")
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": chromium,
                        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                 "--window-size=1280,1500"],
                    },
                }
            }
        }
        self.session = self.call("POST", "/session", caps)["sessionId"]

    def call(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"{}").get("value")
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"WebDriver {method} {path}: {error.code} {error.read()[:400]!r}") from None

    def s(self, method: str, path: str, body=None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def find(self, css: str) -> str:
        found = self.s("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))

    def find_all(self, css: str) -> list:
        return [next(iter(e.values())) for e in self.s("POST", "/elements", {"using": "css selector", "value": css})]

    def type_into(self, element: str, text: str):
        self.s("POST", f"/element/{element}/clear", {})
        self.s("POST", f"/element/{element}/value", {"text": text})

    def click(self, element: str):
        self.s("POST", f"/element/{element}/click", {})

    def script(self, source: str, *args):
        return self.s("POST", "/execute/sync", {"script": source, "args": list(args)})

    def wait_for(self, source: str, what: str, seconds: float = 60):
        deadline = time.time() + seconds
        while time.time() < deadline:
            value = self.script(source)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def quit(self):
        try:
            self.s("DELETE", "")
        finally:
            self.process.terminate()


READ_BARS = """
return [...document.querySelectorAll('.answer')].map(a => ({
  question: a.dataset.question,
  bars: [...a.querySelectorAll('.bar')].map(b => [b.dataset.option, b.dataset.p]),
}));
"""


def main() -> None:
    base, screenshot = sys.argv[1], sys.argv[2]
    driver = Driver(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"), os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    report = {}
    try:
        driver.s("POST", "/url", {"url": base + "/"})
        report["model_line"] = driver.wait_for(
            "const t = document.getElementById('model-line').textContent; return t.includes('family') ? t : null;",
            "the model's description")

        # Evidence, then the default choice question's instructions, a yes/no and a score question.
        driver.type_into(driver.find("#evidence"), "Order 1182: the parcel came two days late, the box was crushed and the lamp inside is broken. I want my money back.")
        driver.type_into(driver.find(".question .q-instructions"), "Which team should handle this ticket?")
        driver.click(driver.find("#add-noul"))
        driver.type_into(driver.find_all(".question .q-name")[-1], "refund")
        driver.type_into(driver.find_all(".question .q-instructions")[-1], "Does the customer ask for a refund?")
        driver.click(driver.find("#add-score"))
        driver.type_into(driver.find_all(".question .q-name")[-1], "mood")
        driver.type_into(driver.find_all(".question .q-instructions")[-1], "How upset is the customer?")
        driver.click(driver.find("#send"))
        driver.wait_for("return document.body.dataset.state === 'answered';", "the answer")
        shown = driver.script(READ_BARS)
        assert [q["question"] for q in shown] == ["team", "refund", "mood"], shown

        # The exact request the page sent (its curl line), sent again straight to the API.
        curl = driver.script("return document.getElementById('code').dataset.curl;")
        body = shlex.split(curl)[shlex.split(curl).index("-d") + 1]
        request = urllib.request.Request(base + "/v1/systemone", data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            api = json.loads(response.read())["answers"]
        compared = 0
        for q in shown:
            answer = api[q["question"]]
            for option, p in q["bars"]:
                if answer["type"] == "noul":
                    want = answer["noul"] if option == "yes" else None
                elif option == "(none)":
                    want = answer["none_probability"]
                else:
                    want = answer["probabilities"][option]
                if want is not None:
                    assert float(p) == want, (q["question"], option, p, want)
                    compared += 1
        report["probabilities_compared"] = compared
        report["shown"] = shown
        driver.s("POST", "/window/rect", {"width": 1280, "height": 1500})
        driver.script("window.scrollTo(0, 0);")
        png = base64.b64decode(driver.s("GET", "/screenshot"))
        with open(screenshot, "wb") as out:
            out.write(png)
        report["screenshot_bytes"] = len(png)

        # Every control is labelled.
        unlabelled = driver.script("""
            return [...document.querySelectorAll('input, select, textarea, button')].filter(e => {
              if (e.closest('[hidden]')) return false;
              if (e.tagName === 'BUTTON') return !(e.textContent.trim() || e.getAttribute('aria-label'));
              return !(e.getAttribute('aria-label') || (e.id && document.querySelector(`label[for="${e.id}"]`)) || e.closest('label'));
            }).map(e => e.outerHTML.slice(0, 80));""")
        assert unlabelled == [], unlabelled

        # 400 px wide: nothing wider than the window.
        driver.s("POST", "/window/rect", {"width": 400, "height": 900})
        width = driver.script("return [document.documentElement.scrollWidth, window.innerWidth];")
        assert width[0] <= width[1], width
        report["narrow"] = width
        driver.s("POST", "/window/rect", {"width": 1280, "height": 1500})

        # An invalid request (a question without instructions) shows the field it names.
        driver.script("document.body.dataset.state = '';")
        driver.s("POST", f"/element/{driver.find('.question .q-instructions')}/clear", {})
        driver.click(driver.find("#send"))
        driver.wait_for("return document.body.dataset.state === 'error';", "the error")
        errors = driver.script("return [...document.querySelectorAll('.field-error')].map(e => [e.dataset.loc, e.textContent]);")
        assert errors and errors[0][0] == "questions.team.instructions", errors
        report["invalid"] = errors
    finally:
        driver.quit()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
