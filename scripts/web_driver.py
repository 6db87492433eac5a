#!/usr/bin/env python3
"""Load a page of the web demo in headless Chromium through chromedriver (WebDriver over HTTP,
Python's standard library only) and wait for its verdict.

  web_driver.py check URL [--screenshot PNG]  wait until #status reads "check: ...", save a
                                              screenshot; exit 0 on "check: PASS", 1 otherwise
  web_driver.py bench URL                     wait until the bench table is done (?bench=...),
                                              print its lines; exit 1 on failure
  web_driver.py no-webgpu URL                 the page in a Chromium without WebGPU must say why
                                              in #status (a readable "check: FAIL ... WebGPU ...")

Chromium's flags come from web/webdriver.json, the file wasm-bindgen-test reads too.
"""
import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def request(base, method, path, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}").get("value")
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"WebDriver {method} {path}: {e.code} {e.read()[:500]!r}") from None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    def __init__(self, webgpu=True):
        driver = shutil.which("chromedriver")
        if not driver:
            sys.exit("chromedriver not found: run scripts/web.sh tools")
        port = free_port()
        self.proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                request(self.base, "GET", "/status", timeout=2)
                break
            except (OSError, RuntimeError):
                time.sleep(0.1)
        else:
            self.proc.terminate()
            raise RuntimeError(f"chromedriver did not answer on port {port}")
        self.session = None
        with open(os.path.join(ROOT, "web", "webdriver.json")) as f:
            caps = json.load(f)
        args = caps["goog:chromeOptions"]["args"] + ["--window-size=1100,1500"]
        if not webgpu:
            args = [a for a in args if "webgpu" not in a] + ["--disable-features=WebGPU"]
        caps["goog:chromeOptions"]["args"] = args
        caps["browserName"] = "chrome"
        try:
            value = request(self.base, "POST", "/session", {"capabilities": {"alwaysMatch": caps}})
        except Exception:
            self.proc.terminate()
            raise
        self.session = f"/session/{value['sessionId']}"

    def go(self, url):
        request(self.base, "POST", self.session + "/url", {"url": url})

    def js(self, script):
        return request(self.base, "POST", self.session + "/execute/sync", {"script": script, "args": []})

    def wait_for(self, script, timeout):
        """Poll `script` until it returns a truthy value; return it (None on timeout)."""
        end = time.time() + timeout
        while time.time() < end:
            v = self.js(script)
            if v:
                return v
            time.sleep(0.5)
        return None

    def screenshot(self, path):
        png = base64.b64decode(request(self.base, "GET", self.session + "/screenshot"))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(png)

    def close(self):
        try:
            if self.session:
                request(self.base, "DELETE", self.session, timeout=10)
        except Exception:
            pass
        self.proc.terminate()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "bench", "no-webgpu"])
    ap.add_argument("url")
    ap.add_argument("--screenshot")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    b = Browser(webgpu=args.mode != "no-webgpu")
    try:
        t0 = time.time()
        b.go(args.url)
        status_js = "const s = document.getElementById('status'); return s ? s.textContent : null;"
        verdict_js = ("const s = document.getElementById('status');"
                      "return s && s.textContent.startsWith('check: ') ? s.textContent : null;")
        if args.mode == "no-webgpu":
            verdict = b.wait_for(verdict_js, 120)
            print(f"without WebGPU: {verdict}")
            return 0 if verdict and verdict.startswith("check: FAIL") and "WebGPU" in verdict else 1
        if args.mode == "check":
            verdict = b.wait_for(verdict_js, args.timeout)
            rows = b.js("return Array.from(document.querySelectorAll('#results tr'))"
                        ".map(r => Array.from(r.cells).map(c => c.textContent).join(' | '));") or []
            print("adapter:", b.js("return document.getElementById('adapter').textContent;"))
            for r in rows:
                print("  " + r)
            if args.screenshot:
                b.screenshot(args.screenshot)
                print("screenshot:", args.screenshot)
            print(f"{verdict or 'no verdict: ' + str(b.js(status_js))} ({time.time() - t0:.0f} s)")
            return 0 if verdict == "check: PASS" else 1
        done = b.wait_for(
            "const t = document.getElementById('bench');"
            "const s = document.getElementById('status').textContent;"
            "if (/^(bench|check): FAIL/.test(s)) return s;"
            "return t && t.dataset.done !== undefined ? 'done\\n' + t.dataset.done : null;",
            args.timeout)
        if done and done.startswith("done"):
            print(done.split("\n", 1)[1].rstrip())
        else:
            print(done or f"no result: {b.js(status_js)}")
        return 0 if done and done.startswith("done") else 1
    finally:
        b.close()


if __name__ == "__main__":
    sys.exit(main())
