"""Images on every route (issue #71), through HTTP with the `openai` and `anthropic` SDKs, on the
tiny random Gemma 3 vision model: chat `image_url` parts (data: URLs, and a remote URL from an
allowed host), Responses `input_image` parts and Messages `image` blocks answer as transformers
does on the prompt its own Gemma3Processor builds; the same picture again is a prefix hit that
is not encoded again, another picture a miss; hostile images are 400s in each route's shape."""

from __future__ import annotations

import base64
import http.server
import shutil
import struct
import threading
import zlib
from pathlib import Path

import httpx
import pytest
import torch

from tests.openai_schema import validate
from tests.server_utils import InProcessServer
from tests.vision_model import IMAGE, TOKENS_PER_IMAGE, build_gemma3_vlm, data_url, png

QUESTION = "What is this?"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm-http") / "vlm")


class _Pictures(http.server.BaseHTTPRequestHandler):
    """A local image host: /cat.png is png(11); /moved redirects to it."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = png(11)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def picture_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


@pytest.fixture(scope="module")
def server(vlm, picture_host):
    s = InProcessServer(
        vlm,
        engine={"block_size": 4, "max_num_batched_tokens": 64},
        allowed_media_domains=["127.0.0.1"],
        max_images_per_request=3,
        max_image_bytes=200_000,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(vlm):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(vlm), model


def expected(reference, seeds: list[int]) -> tuple[str, int, int]:
    """transformers' greedy answer (to the first EOS), prompt length and first soft token's
    position, on the prompt its own processor builds from the same chat template and
    pictures."""
    import io

    from PIL import Image

    processor, model = reference
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.open(io.BytesIO(png(s))) for s in seeds]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    new = new[: next((i for i, t in enumerate(new) if t in eos), len(new))]
    ids = inputs["input_ids"][0].tolist()
    text = processor.tokenizer.decode(new, skip_special_tokens=True)
    return text, len(ids), ids.index(IMAGE)


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


def messages_image(server, picture: bytes, question: str, max_tokens: int, **extra):
    """An `anthropic` SDK Messages call with one base64 PNG `image` block and a question
    (greedy; `extra`: more body fields); returns the message."""
    from anthropic import Anthropic

    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(picture).decode(),
        },
    }
    return Anthropic(base_url=server.base, api_key="x", max_retries=0).messages.create(
        model="vlm",
        max_tokens=max_tokens,
        extra_body={"temperature": 0.0, **extra},
        messages=[{"role": "user", "content": [image, {"type": "text", "text": question}]}],
    )


def assert_responses_and_messages_answer(
    server, picture: bytes, question: str, max_tokens: int, answer: str, prompt_len: int
) -> None:
    """One picture and a question as a Responses `input_image` part and as a Messages `image`
    block, greedy: each answers `answer` on a prompt of `prompt_len` tokens (on Messages, those
    read from the prefix cache and those not)."""
    resp = openai_client(server).responses.create(
        model="vlm",
        max_output_tokens=max_tokens,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(picture)},
                    {"type": "input_text", "text": question},
                ],
            }
        ],
    )
    assert resp.output_text == answer and resp.usage.input_tokens == prompt_len
    msg = messages_image(server, picture, question, max_tokens)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == answer
    usage = msg.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt_len


def chat(server, *urls: str):
    """A greedy chat call: the pictures at these URLs, then QUESTION."""
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": QUESTION})
    return openai_client(server).chat.completions.create(
        model="vlm",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )


def metric(server, name: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.split(" ")[0] in (f"kvserve:{name}", f"kvserve:{name}_total")
    )
    return float(line.split()[-1])


def test_every_route_answers_images_as_transformers(server, reference) -> None:

    answer, prompt_len, _ = expected(reference, [1])
    r = chat(server, data_url(png(1)))
    assert r.choices[0].message.content == answer
    assert r.usage.prompt_tokens == prompt_len  # the image's soft tokens counted
    assert r.usage.prompt_tokens_details.image_tokens == TOKENS_PER_IMAGE
    two, two_len, _ = expected(reference, [1, 2])
    r = chat(server, data_url(png(1)), data_url(png(2)))
    assert r.choices[0].message.content == two and r.usage.prompt_tokens == two_len
    assert r.usage.prompt_tokens_details.image_tokens == 2 * TOKENS_PER_IMAGE
    validate("CreateChatCompletionResponse", r.model_dump(exclude_unset=True))
    assert_responses_and_messages_answer(server, png(1), QUESTION, MAX_TOKENS, answer, prompt_len)


def test_same_picture_is_a_prefix_hit_encoded_once_another_a_miss(server, reference) -> None:
    misses, hits = metric(server, "encoder_cache_misses"), metric(server, "encoder_cache_hits")
    _, _, image_start = expected(reference, [21])
    first = chat(server, data_url(png(21)))
    # the text before the image was asked before; the block holding the image's first soft
    # token misses
    assert first.usage.prompt_tokens_details.cached_tokens == image_start // 4 * 4
    assert metric(server, "encoder_cache_misses") == misses + 1
    again = chat(server, data_url(png(21)))
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 4 * 4  # every full block, the image's too
    assert metric(server, "encoder_cache_misses") == misses + 1  # its KV came from the cache
    other = chat(server, data_url(png(22)))  # the same tokens, another picture
    assert other.usage.prompt_tokens_details.cached_tokens == image_start // 4 * 4
    assert metric(server, "encoder_cache_misses") == misses + 2
    assert other.choices[0].message.content == expected(reference, [22])[0]
    assert metric(server, "encoder_cache_hits") == hits


def test_a_remote_picture_from_an_allowed_host(server, picture_host, reference) -> None:
    """The fetched file is the same picture as the data: URL of its bytes: one content hash,
    so the second is a prefix hit."""
    fetched = chat(server, picture_host + "/cat.png")
    assert fetched.choices[0].message.content == expected(reference, [11])[0]
    inline = chat(server, data_url(png(11)))
    assert inline.usage.prompt_tokens_details.cached_tokens > 0
    assert inline.choices[0].message.content == fetched.choices[0].message.content


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


HOSTILE = [
    (data_url(png(5)[:80]), "damaged"),
    (data_url(png(5, (1, 1))), "smaller than 2 pixels"),
    (data_url(_png_header(40_000, 40_000)), "over the limit"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    (data_url(b"hello, not a picture"), "not a readable image"),
    (data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), "not a readable"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    (data_url(png(5, (300, 300))), "larger than 200000 bytes"),
    ("http://example.com/cat.png", "allowed_media_domains"),
    ("file:///etc/passwd", "data: URL or an http(s) URL"),
]


def test_hostile_images_are_400s_on_every_route(server, picture_host) -> None:
    body = {"model": "vlm", "max_tokens": 4}
    with httpx.Client(base_url=server.base, timeout=30) as c:
        for url, why in [*HOSTILE, (picture_host + "/moved", "HTTP 302")]:
            parts = [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            r = c.post(
                "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": parts}]},
            )
            assert r.status_code == 400, (why, r.text)
            err = r.json()["error"]
            assert err["param"] == "messages.0.content.1" and why in err["message"], err
            validate("ErrorResponse", r.json())
            part = {"type": "input_image", "image_url": url}
            message = {"role": "user", "content": [part]}
            r = c.post("/v1/responses", json={"model": "vlm", "input": [message]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.0"
        image = {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(png(5)[:80]).decode(),
            },
        }
        r = c.post(
            "/v1/messages", json={**body, "messages": [{"role": "user", "content": [image]}]}
        )
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith("messages.0.content.0: the PNG data is damaged")
        many = [{"type": "image_url", "image_url": {"url": data_url(png(k))}} for k in range(4)]
        r = c.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": many}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.3"
        assert "at most 3 images" in r.json()["error"]["message"]
        typed = [{"type": "text", "text": "<image_soft_token> is a token"}]  # a forged placeholder
        r = c.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": typed}]}
        )
        assert r.status_code == 400, r.text
    snap = server.core.snapshot()
    assert snap.num_running == snap.num_waiting == 0 and "2" not in snap.block_map


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium not installed")
def test_the_page_sends_a_pasted_image(server, reference) -> None:
    """The built-in page in headless Chromium: an image pasted into the message box goes with
    the next message as an image_url part; the answer is transformers'."""
    from playwright.sync_api import sync_playwright

    misses = metric(server, "encoder_cache_misses")
    with sync_playwright() as p:
        args = ["--headless", "--no-sandbox", "--disable-gpu"]
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=args)
        page = browser.new_page()
        page.goto(server.base + "/")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", str(MAX_TOKENS))
        page.fill("#system", "")  # the tiny model's template: a user turn alone
        page.evaluate(
            """(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
                const input = document.getElementById("input");
                const paste = { clipboardData: data, bubbles: true, cancelable: true };
                input.dispatchEvent(new ClipboardEvent("paste", paste));
            }""",
            base64.b64encode(png(31)).decode(),
        )
        page.wait_for_function("document.getElementById('attached').textContent.includes('1')")
        page.fill("#input", QUESTION)
        page.click("#send")
        page.wait_for_function(
            "document.getElementById('reply-stats').textContent.includes('TTFT')"
        )
        reply = page.locator(".msg.assistant .body").last.text_content()
        browser.close()
    assert metric(server, "encoder_cache_misses") == misses + 1
    assert reply == expected(reference, [31])[0]
