"""Qwen2.5-VL and Qwen3-VL through HTTP with the `openai` and `anthropic` SDKs (issue #71), on
the tiny random checkpoints (tests/test_qwen_vl.py's families):
chat `image_url` parts with one picture and with two of different sizes (each its own number
of soft tokens and M-RoPE grid), a Responses `input_image` and a Messages `image` block answer
as transformers does on
the prompt its chat template and image processor build; the same picture again is a prefix
hit that is not encoded again; an image the processor cannot resize is a 400."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.qwen_vl_model import IMAGE_PAD
from tests.server_utils import InProcessServer
from tests.test_qwen_vl import BUILDERS
from tests.test_vision_server import (
    MAX_TOKENS,
    QUESTION,
    assert_responses_and_messages_answer,
    metric,
)
from tests.test_vision_server import chat as chat_with_images
from tests.vision_model import data_url, png

SIZES = {1: (40, 30), 2: (20, 28), 21: (36, 36)}


@pytest.fixture(scope="module", params=list(BUILDERS))
def qvl(request, tmp_path_factory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp(f"{request.param}-http") / "vlm")


@pytest.fixture(scope="module")
def server(qvl):
    s = InProcessServer(qvl, engine={"block_size": 4, "max_num_batched_tokens": 64})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(qvl):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    architecture = json.loads((qvl / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(qvl, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(qvl)
    return tokenizer, Qwen2VLImageProcessorPil.from_pretrained(qvl), model


def expected(reference, seeds: list[int]) -> tuple[str, int, int]:
    """transformers' greedy answer (to the first EOS) as the server sends it, the prompt's
    length and its image
    tokens: the chat template rendered by the tokenizer, each <|image_pad|> widened to the
    merged patches of the grid transformers' image processor gives the picture (what
    Qwen2_5_VLProcessor does; the processor itself needs torchvision for its video half)."""
    import io

    from PIL import Image

    tokenizer, images, model = reference
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": QUESTION}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(io.BytesIO(png(s, SIZES[s]))) for s in seeds]
    pixels = images(images=pictures, return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    counts = [int(g.prod()) // 4 for g in pixels["image_grid_thw"]]
    text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            **pixels,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            mm_token_type_ids=(ids == IMAGE_PAD).int(),
        )
    new = out[0, ids.shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    new = new[: next((i for i, t in enumerate(new) if t in eos), len(new))]
    # the server never sends an incomplete UTF-8 sequence (engine/core/detokenizer.py holds a
    # trailing U+FFFD back, and drops it at the end, as vLLM does): random byte-level tokens
    # often end on one
    text = tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd")
    return text, ids.shape[1], sum(counts)


def chat(server, *seeds: int):
    """test_vision_server's greedy chat call with the pictures of these seeds, each its size."""
    return chat_with_images(server, *(data_url(png(s, SIZES[s])) for s in seeds))


def test_chat_and_responses_answer_images_as_transformers(server, reference) -> None:
    for seeds in ([1], [1, 2]):
        answer, prompt_len, image_tokens = expected(reference, seeds)
        r = chat(server, *seeds)
        assert r.choices[0].message.content == answer
        assert r.usage.prompt_tokens == prompt_len
        assert r.usage.prompt_tokens_details.image_tokens == image_tokens
    answer, prompt_len, _ = expected(reference, [2])
    assert_responses_and_messages_answer(
        server, png(2, SIZES[2]), QUESTION, MAX_TOKENS, answer, prompt_len
    )


def test_same_picture_is_a_prefix_hit_encoded_once(server, reference) -> None:
    misses = metric(server, "encoder_cache_misses")
    first = chat(server, 21)
    assert metric(server, "encoder_cache_misses") == misses + 1
    again = chat(server, 21)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].message.content == expected(reference, [21])[0]
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert metric(server, "encoder_cache_misses") == misses + 1


@pytest.mark.parametrize("qvl", ["qwen2.5-vl"], indirect=True)  # one processor for both
def test_an_image_the_processor_cannot_resize_is_a_400(server) -> None:
    thin = data_url(png(5, (500, 2)))  # aspect ratio 250: Qwen's processor refuses it
    parts = [{"type": "image_url", "image_url": {"url": thin}}, {"type": "text", "text": "hi"}]
    r = httpx.post(
        server.base + "/v1/chat/completions",
        timeout=30,
        json={"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]},
    )
    assert r.status_code == 400, r.text
    assert "aspect ratio" in r.json()["error"]["message"]
    snap = server.core.snapshot()
    assert snap.num_running == snap.num_waiting == 0
