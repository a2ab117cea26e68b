"""Regenerate docs/ui.png: the built-in page during a streamed reply from the default model.

.venv/bin/python scripts/screenshot.py
"""

from __future__ import annotations

import shutil

from playwright.sync_api import sync_playwright

from harness.launch import ROOT, Server

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def main() -> None:
    out = str(ROOT / "docs" / "ui.png")
    with Server([]) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(server.base + "/")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "120")
        page.fill("#input", "What is the capital of France?")
        page.click("#send")
        page.wait_for_function(
            "document.querySelector('#send').disabled === false", timeout=120_000
        )
        page.fill("#input", "Tell me three things to see there.")
        page.click("#send")
        page.wait_for_function(
            "document.querySelectorAll('.msg.assistant .body')[1].textContent.length > 60",
            timeout=120_000,
        )
        page.wait_for_timeout(1200)  # let the panel refresh mid-reply
        page.screenshot(path=out)
        browser.close()
    print("wrote", out)


if __name__ == "__main__":
    main()
