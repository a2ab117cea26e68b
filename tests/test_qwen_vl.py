"""Qwen2.5-VL and Qwen3-VL through the engine (issue #71), each against transformers float32 on
a tiny random `Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration` (every
test runs on both): the dynamic-resolution processor's patches and the tower's soft tokens
(Qwen3-VL's deepstack features too); logits and greedy text for prompts with one image and with
two of different sizes (different grids, so different M-RoPE positions), prefilled whole and in
chunks that split an image (its tokens are causal; Qwen3-VL's deepstack additions reach the
rows of each chunk); the same picture again is a prefix hit encoded once, another picture at
the same place a miss."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.images import PromptImage
from engine.core.sampling_params import ParamError
from models.image_processor import content_hash, decode_image
from models.qwen_image_processor import QwenImageProcessor
from tests.qwen_vl_model import IMAGE_PAD, build_qwen3_vl, build_qwen25_vl
from tests.vision_model import (
    assert_like_reference,
    greedy_reference,
    png,
    reference_run,
    run_request,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SIZES = {1: (40, 30), 2: (20, 28), 3: (40, 30)}  # seed -> picture size (a 4x5, 2x4, 4x5 grid)


BUILDERS = {"qwen2.5-vl": build_qwen25_vl, "qwen3-vl": build_qwen3_vl}


@pytest.fixture(scope="module", params=list(BUILDERS))
def qvl(request, tmp_path_factory) -> str:
    """A tiny random checkpoint of each family, built once for the module."""
    return str(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "vlm"))


@pytest.fixture(scope="module")
def reference(qvl):
    """transformers' model of the same checkpoint: the numbers every test compares with."""
    architecture = json.loads((Path(qvl) / "config.json").read_text())["architectures"][0]
    return greedy_reference(architecture, qvl)


def processor(qvl: str) -> QwenImageProcessor:
    from models.loader import load_spec

    return QwenImageProcessor.read(qvl, load_spec(qvl).vision.tower_config)


def prompt(llm: LLM, qvl: str, seeds: list[int], question: str = "What is this?"):
    """Token ids of a user turn with an image per seed, widened as Qwen's processor does (an
    <|image_pad|> a merged patch), and the images placed at their soft tokens."""
    loaded = [processor(qvl).process(decode_image(png(s, SIZES[s]), 10**7, 2)) for s in seeds]
    counts = [g[0] * g[1] * g[2] // 4 for _, g in loaded]
    text = "<|im_start|>user\n" + "".join(
        "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" for n in counts
    )
    text += f"{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    images, at = [], 0
    for (pixels, grid), n in zip(loaded, counts):
        at = ids.index(IMAGE_PAD, at)
        images.append(
            PromptImage(
                at, n, content_hash(pixels, grid), torch.from_numpy(pixels), grid, two_way=False
            )
        )
        at += n
    return ids, tuple(images)


def theirs(reference, ids, images, generate: int = 0):
    kw = dict(input_ids=torch.tensor([ids]))
    if images:
        kw |= dict(
            pixel_values=torch.cat([i.pixels for i in images]),
            image_grid_thw=torch.tensor([i.grid for i in images]),
            mm_token_type_ids=torch.tensor([[int(t == IMAGE_PAD) for t in ids]]),
        )
    return reference_run(reference, kw, len(ids), generate)


def run(llm: LLM, ids, images, params=GREEDY, rid="r"):
    return run_request(llm, ids, images, params, rid)


def test_patches_and_soft_tokens_match_transformers(qvl, reference) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from models.loader import load_spec
    from models.vision import load_image_encoder

    encoder = load_image_encoder(qvl, load_spec(qvl), torch.float32, "cpu")
    ref = Qwen2VLImageProcessorPil.from_pretrained(qvl)
    for size in [(40, 30), (53, 17), (200, 150)]:  # edge windows; a resize down to max_pixels
        image = decode_image(png(3, size), 10**7, 2)
        pixels, grid = processor(qvl).process(image)
        want = ref(images=[image], return_tensors="pt")
        assert [list(grid)] == want["image_grid_thw"].tolist()
        assert (want["pixel_values"] - torch.from_numpy(pixels)).abs().max() < 1e-6
        with torch.no_grad():
            out = reference.model.get_image_features(want["pixel_values"], want["image_grid_thw"])
        deepstack = [layer[0] for layer in getattr(out, "deepstack_features", None) or ()]
        soft = torch.cat([out.pooler_output[0], *deepstack], dim=1)  # Qwen3-VL's beside
        ours = encoder.encode([torch.from_numpy(pixels)], [grid])[0]
        assert ours.shape == soft.shape
        assert (ours - soft).abs().max() < 1e-5 * soft.abs().max()


def test_one_and_two_images_match_transformers(qvl, reference) -> None:
    """Logits of the whole prompt in one step; greedy text prefilled in chunks of 5 tokens
    that end inside images (causal soft tokens: the rest of the image comes in the next chunk,
    its embeddings from the encoder cache), then decoded at positions past the prompt's
    largest M-RoPE position."""
    llm = LLM(
        qvl, num_kv_blocks=64, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False
    )
    for seeds in ([1], [1, 2], []):  # and text alone, on one-axis positions
        ids, images = prompt(llm, qvl, seeds)
        assert_like_reference(llm, ids, images, partial(theirs, reference), GREEDY)
    assert llm.engine.runner.images.cache.stats().encoded == 2  # each picture once
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


@pytest.fixture(scope="module")
def cached_llm(qvl) -> LLM:
    return LLM(qvl, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)


def test_same_picture_is_a_prefix_hit_encoded_once(cached_llm, qvl, reference) -> None:
    llm = cached_llm
    ids, images = prompt(llm, qvl, [1])
    first, cached = run(llm, ids, images, rid="a")
    assert cached == 0
    again, cached = run(llm, ids, images, rid="b")
    assert again == first and cached == len(ids) - 1  # the image's blocks too (a partial tail)
    other_ids, other = prompt(llm, qvl, [3])  # a picture of the same size at the same place
    assert other_ids == ids and other[0].content_hash != images[0].content_hash
    tokens, cached = run(llm, other_ids, other, rid="c")
    assert cached == images[0].offset // 4 * 4  # up to the block holding the image
    assert tokens == theirs(reference, other_ids, other, generate=GREEDY.max_tokens)
    stats = llm.engine.runner.images.cache.stats()
    assert (stats.encoded, stats.hits) == (2, 0)  # the hit's KV was cached: no encoder run


def test_an_image_the_tower_cannot_read_is_refused(cached_llm, qvl) -> None:
    llm = cached_llm
    ids, (image,) = prompt(llm, qvl, [2])
    wrong = [
        PromptImage(image.offset, image.num_tokens, image.content_hash, image.pixels),  # no grid
        PromptImage(
            image.offset,
            image.num_tokens,
            image.content_hash,
            image.pixels[:-1],
            image.grid,
            two_way=False,
        ),
        PromptImage(
            image.offset,
            image.num_tokens,
            image.content_hash,
            image.pixels,
            image.grid,
            two_way=True,
        ),
    ]
    for bad in wrong:
        with pytest.raises(ParamError):
            llm.engine.validate_prompt(ids, GREEDY, (bad,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_tables_match_transformers(interleaved: bool) -> None:
    """Sectioned (Qwen2.5-VL) and interleaved (Qwen3-VL's layout, for its decoder) M-RoPE
    cos/sin equal transformers' rotary embeddings on positions whose axes differ."""
    from transformers import Qwen2_5_VLTextConfig, Qwen3VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from models.mrope import mrope_axes, mrope_cos_sin

    section = [4, 6, 6]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    kind = (
        (Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding)
        if interleaved
        else (Qwen2_5_VLTextConfig, Qwen2_5_VLRotaryEmbedding)
    )
    config = kind[0](hidden_size=128, num_attention_heads=4, head_dim=32, rope_parameters=rope)
    table = kind[1](config)
    positions = torch.tensor([[6, 6, 6, 11, 40], [6, 7, 9, 11, 3], [10, 6, 8, 11, 17]])
    cos, sin = table(torch.zeros(1), positions[:, None, :])
    ours = mrope_cos_sin(positions, table.inv_freq, mrope_axes(section, interleaved))
    for want, got in zip((cos[0], sin[0]), ours):
        assert (want[:, :16] - got[:, 0]).abs().max() < 1e-6
        assert (want[:, 16:] - got[:, 0]).abs().max() < 1e-6


def assert_two_image_requests_answer(llm: LLM, qvl: str, reference) -> None:
    """Two image requests at once in `llm`'s small pool: one is preempted, and both answer as
    transformers does."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine, want = llm.engine, {}
    for rid, seeds in (("a", [1]), ("b", [2])):
        ids, images = prompt(llm, qvl, seeds)
        engine.add_request(rid, ids, params, images=images)
        want[rid] = theirs(reference, ids, images, generate=params.max_tokens)
    got: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] += out.new_token_ids
    assert got == want
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("qvl", ["qwen2.5-vl"], indirect=True)  # the path is one for both
def test_preempted_image_request_resumes_on_its_positions(qvl, reference) -> None:
    """Two image requests in a pool too small for both: the newer is preempted (recomputed from
    its first token, outputs included) and still answers as transformers does."""
    llm = LLM(
        qvl, num_kv_blocks=23, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    assert_two_image_requests_answer(llm, qvl, reference)


@pytest.mark.parametrize("qvl", ["qwen2.5-vl"], indirect=True)  # the path is one for both
def test_the_host_tier_keeps_an_image_request_on_its_positions(qvl, reference) -> None:
    """With a host tier, a preempted image request swaps its blocks out and back and answers as
    transformers does (its M-RoPE positions stay the request's); then a picture's blocks are
    offloaded as an idle session's are, and the same picture again meets them in the host tier
    and answers the same."""
    llm = LLM(qvl, num_kv_blocks=23, block_size=4, max_num_batched_tokens=64, host_bytes="8MiB")
    assert_two_image_requests_answer(llm, qvl, reference)
    engine = llm.engine
    ids, images = prompt(llm, qvl, [3])
    first, _ = run(llm, ids, images, rid="c")
    assert engine.offload_prefix(ids, None, images) > 0
    host_before = engine.kv.hits_by_source["host"]
    again, cached = run(llm, ids, images, rid="d")
    assert again == first and cached == len(ids) - 1  # the image's blocks too (a partial tail)
    assert engine.kv.hits_by_source["host"] > host_before


def test_the_encoder_cost_is_measured_on_a_dynamic_resolution_image(cached_llm) -> None:
    assert cached_llm.engine.scheduler.image_cost > 0


def test_a_qwen3_tower_it_cannot_read_is_refused_at_startup() -> None:
    """What Qwen3-VL's tower cannot compute as transformers does is a load error, with why."""
    from dataclasses import replace

    from models.qwen3_vision import Qwen3VisionTower
    from models.qwen_vision import QwenVisionSpec

    good = QwenVisionSpec(2, 8, 16, 2, 8, 4, num_position_embeddings=16)
    assert Qwen3VisionTower(good).side == 4
    for bad, why in [
        (replace(good, num_position_embeddings=15), "not a square grid"),
        (replace(good, deepstack_visual_indexes=(1, 2)), "outside the tower's 2"),
        (replace(good, window_size=16), "no attention windows"),
    ]:
        with pytest.raises(ValueError, match=why):
            Qwen3VisionTower(bad)
