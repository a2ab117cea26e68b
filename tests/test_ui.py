"""The built-in page in headless Chromium (Debian's chromium, driven by Playwright): a streamed
reply appears, Stop aborts server-side, the block map follows the cache, and model output is
shown as text."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

from tests.server_utils import server_fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium not installed"),
]
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
KEY = "ui-key"


server = server_fixture(num_kv_blocks=64, api_key=KEY, max_model_len=4096)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser, server):
    context = browser.new_context()
    page = context.new_page()
    page.add_init_script(f"sessionStorage.setItem('kvserve-key', '{KEY}')")
    page.goto(server.base + "/")
    yield page
    context.close()


def metric(server, name: str) -> float:
    text = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(rf"^kvserve:{name} (\S+)$", text, re.M).group(1))


def cells(page, kind: str) -> int:
    return page.locator(f"#blocks .cell.{kind}").count()


def test_chat_streams_and_block_map_changes(page, server) -> None:
    page.wait_for_function("document.querySelectorAll('#blocks .cell').length > 0")
    assert cells(page, "cached") == 0
    page.fill("#max-tokens", "40")
    page.fill("#input", "Hello there, tell me a story " * 20)
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    page.wait_for_function(
        "document.querySelector('.msg.assistant .meta') !== null", timeout=60_000
    )
    assert len(reply.locator(".body").inner_text()) > 0
    assert "TTFT" in reply.locator(".meta").inner_text()
    assert "cached" in page.locator("#reply-stats").inner_text()
    page.wait_for_function(
        "document.querySelectorAll('#blocks .cell.cached').length > 0", timeout=10_000
    )
    # the applications table: a row per application, its name shown as text
    hostile = '<img src=x onerror="window.__pwned=3">'
    headers = {"Authorization": f"Bearer {KEY}", "X-App": hostile}
    model = httpx.get(server.base + "/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(server.base + "/v1/chat/completions", json=body, headers=headers).is_success
    page.wait_for_function("document.querySelectorAll('#apps tbody tr').length >= 2")
    assert hostile in page.locator("#apps").inner_text()
    assert page.locator("#apps img").count() == 0 and page.locator("#apps svg").count() >= 2


def test_stop_aborts_server_side(page, server) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    page.fill("#max-tokens", "4000")
    page.fill("#temperature", "1.5")
    for _attempt in range(5):  # a random tiny model may emit EOS early; then ask again
        page.click("#clear")
        page.fill("#input", "Write forever")
        page.click("#send")
        page.wait_for_function(
            "document.querySelector('.msg.assistant .body').textContent.length > 20"
            " || !document.querySelector('#send').disabled",
            timeout=60_000,
        )
        if page.locator("#send").is_disabled() and metric(server, "num_requests_running") == 1:
            try:  # the reply may still end (EOS) before the click lands: then ask again
                page.click("#stop", timeout=5_000)
                break
            except PlaywrightTimeoutError:
                pass
        page.wait_for_function("!document.querySelector('#send').disabled", timeout=60_000)
    else:
        pytest.fail("every reply ended before it could be stopped")
    deadline = time.monotonic() + 10
    while metric(server, "num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "num_requests_running") == 0
    assert page.locator(".msg.assistant .meta").last.inner_text() == "stopped"


def test_model_output_is_text_not_html(page) -> None:
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned=2"><b>x</b>'
    sse = (
        "".join(
            f"data: {json.dumps(c)}\n\n"
            for c in [
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {"content": hostile[:20]}}]},
                {"choices": [{"index": 0, "delta": {"content": hostile[20:]}}]},
            ]
        )
        + "data: [DONE]\n\n"
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=sse
        ),
    )
    page.fill("#input", "<i>user html</i>")
    page.click("#send")
    page.wait_for_function("document.querySelector('#send').disabled === false")
    reply = page.locator(".msg.assistant").last
    assert reply.locator(".body").inner_text() == hostile
    assert reply.locator("script, img, b").count() == 0
    assert page.locator(".msg.user i").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_page_loads_without_key_and_stats_need_it(server) -> None:
    assert httpx.get(server.base + "/").status_code == 200
    assert httpx.get(server.base + "/ui/app.js").status_code == 200
    assert httpx.get(server.base + "/v1/stats").status_code == 401
