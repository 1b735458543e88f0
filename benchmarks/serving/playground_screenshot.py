"""Check the playground page of ``genspec serve`` in headless Chromium and take a screenshot.

Starts ``genspec serve`` on loopback (127.0.0.1) with the embedded model (or ``--model``), opens
``/?prompt=...&autorun=1`` in Debian's Chromium (``apt install chromium``) driven by Playwright
(``pip install playwright``; no browser download: it uses /usr/bin/chromium), waits until the page has
streamed a greedy completion to its end, then checks the rendered page (the completion is there, split
into tokens from accepted drafts and tokens the target produced, with the acceptance figures filled in)
and writes the screenshot. Stops the server and exits non-zero if any check fails.

    python benchmarks/serving/playground_screenshot.py --out docs/assets/playground.png
"""
from __future__ import annotations

import argparse
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx

PROMPT = ("Question: Rewrite this function with a docstring.\n\ndef area_of_square(side):\n    return side * side\n\n"
          "Answer:\n\ndef area_of_square(side):")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--out", default="bench_results/playground.png")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "genspec", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--no-cost-measurement"] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                print(f"server exited: {server.stderr.read()}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() > deadline:
                    print("server did not start in 5 minutes", file=sys.stderr)
                    return 1
                time.sleep(1)
        page_url = f"{url}/?{urllib.parse.urlencode({'prompt': PROMPT, 'max_tokens': args.max_tokens, 'autorun': 1})}"
        from playwright.sync_api import sync_playwright

        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=BROWSER, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 820})
            page.goto(page_url)
            page.wait_for_selector("body[data-done='true']", timeout=300_000)
            drafted = page.locator("#output span.draft").count()
            produced = page.locator("#output span.target").count()
            acceptance = page.locator("#s_acceptance").inner_text()
            tokens = int(page.locator("#s_tokens").inner_text())
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        checks = {"tokens from accepted drafts shown": drafted > 0,
                  "tokens from the target shown": produced > 0,
                  "every streamed token shown once": drafted + produced == tokens > 0,
                  "acceptance figure filled in": bool(re.fullmatch(r"[01]\.\d\d", acceptance))}
        for name, ok in checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {name}")
        print(f"{drafted} tokens from drafts, {produced} from the target, acceptance {acceptance}")
        print(f"screenshot: {out}")
        return 0 if all(checks.values()) else 1
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"

if __name__ == "__main__":
    sys.exit(main())
