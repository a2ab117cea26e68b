"""Gemma 3 with images through the engine (issue #71), against transformers float32 on a tiny
random `Gemma3ForConditionalGeneration`: the processor's pixels, logits and greedy text for
prompts with one and two images (prefilled whole and in chunks that may not split an image),
the image's content hash in the block hashes (the same picture is a prefix hit, another one a
miss) and the encoder cache (a repeated picture is encoded once)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.images import PromptImage, cut_at_image
from engine.core.sampling_params import ParamError
from models.image_processor import ImageProcessor, content_hash, decode_image
from tests.vision_model import (
    IMAGE,
    TOKENS_PER_IMAGE,
    assert_like_reference,
    build_gemma3_vlm,
    greedy_reference,
    png,
    reference_run,
    run_request,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
EXPANDED = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return str(build_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm") / "vlm"))


@pytest.fixture(scope="module")
def reference(vlm):
    return greedy_reference("Gemma3ForConditionalGeneration", vlm)


def prompt(llm: LLM, vlm: str, seeds: list[int], question: str = "What is this?"):
    """Token ids of a user turn with an image per seed, as Gemma 3's processor expands them,
    and the images placed at their soft tokens."""
    text = "<bos><start_of_turn>user\n" + "".join(EXPANDED for _ in seeds)
    text += f"{question}<end_of_turn>\n<start_of_turn>model\n"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    processor = ImageProcessor.read(vlm, 28)
    images, at = [], 0
    for seed in seeds:
        pixels = processor(decode_image(png(seed), 10**7, 2))
        at = ids.index(IMAGE, at)
        images.append(
            PromptImage(at, TOKENS_PER_IMAGE, content_hash(pixels), torch.from_numpy(pixels))
        )
        at += TOKENS_PER_IMAGE
    return ids, tuple(images)


def theirs(reference, ids, images, generate: int = 0):
    kw = dict(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.stack([i.pixels for i in images]),
        token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]),
    )
    return reference_run(reference, kw, len(ids), generate)


def run(llm: LLM, ids, images, params=GREEDY, rid="r"):
    return run_request(llm, ids, images, params, rid)


def test_pixels_match_transformers_pil_processor(vlm) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image = decode_image(png(3, (53, 17)), 10**7, 2)
    ours = ImageProcessor.read(vlm, 28)(image)
    ref = Gemma3ImageProcessorPil.from_pretrained(vlm)(images=[image], return_tensors="np")
    assert ours.shape == (3, 28, 28)
    assert abs(ref["pixel_values"][0] - ours).max() < 1e-6


@pytest.mark.parametrize("chunk", [64, 5])
def test_one_and_two_images_match_transformers(vlm, reference, chunk: int) -> None:
    """Whole prefills, and chunks of 5 tokens: a chunk that would end inside an image stops
    before it or takes the image whole, so the image's two-way attention is the same."""
    llm = LLM(
        vlm,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    for seeds in ([1], [1, 2]):
        ids, images = prompt(llm, vlm, seeds)
        ref = assert_like_reference(llm, ids, images, partial(theirs, reference), GREEDY)
    # the two-way span matters: transformers' causal-only answer differs from this one
    with torch.no_grad():
        pixels = torch.stack([i.pixels for i in images])
        causal = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    assert (causal - ref).abs().max().item() > 1e-3
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_chunks_never_end_inside_an_image() -> None:
    image = PromptImage(10, 4, b"h", torch.zeros(3, 1, 1))
    assert cut_at_image([image], 0, 12) == 10  # stops before it
    assert cut_at_image([image], 10, 2) == 4  # begins at it: takes it whole
    assert cut_at_image([image], 12, 1) == 2  # begins inside it (a prefix hit): its remainder
    assert cut_at_image([image], 0, 14) == 14 and cut_at_image([image], 0, 9) == 9


def test_an_image_is_prefill_work_in_the_step_budget() -> None:
    """The scheduler charges a chunk's images at the encoder's measured cost: beside a
    prompt whose chunk holds an image, a second prompt gets that much less of the step."""
    from engine.core.images import encoder_charge
    from engine.core.scheduler import Scheduler
    from engine.core.step_budget import StepBudget
    from engine.kv.manager import KVCacheManager
    from tests.test_scheduler import request

    image = PromptImage(2, 4, b"h", torch.zeros(3, 1, 1))
    assert encoder_charge([image], 0, 2, 2.5) == 0  # the chunk stops before it
    assert encoder_charge([image], 0, 8, 2.5) == 10 and encoder_charge([image], 2, 1, 2.5) == 10
    assert encoder_charge([image], 4, 4, 2.5) == 0  # a split image's rest: in the encoder cache
    assert encoder_charge([image], 4, 4, 2.5, admitted=True) == 10  # a hit that ends inside it
    assert encoder_charge([image], 0, 8, 0.0) == 0
    granted = {}
    for cost in (0.0, 2.0):
        sched = Scheduler(KVCacheManager(32, 4), 4, StepBudget(24), image_cost=cost)
        with_image = request("img", list(range(1, 9)), 2)
        with_image.images = (image,)
        sched.add(with_image)
        sched.add(request("text", list(range(10, 30)), 2))
        out = sched.schedule()
        granted[cost] = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert granted[0.0] == {"img": 8, "text": 16}
    assert granted[2.0] == {"img": 8, "text": 8}  # 24 - 8 - 4 soft tokens x 2
    assert out.encoder_tokens == 8  # what the step's cost is predicted from, beside its tokens


def test_the_encoder_cost_is_measured_at_startup(cached_llm) -> None:
    assert cached_llm.engine.scheduler.image_cost > 0


@pytest.fixture(scope="module")
def cached_llm(vlm) -> LLM:
    return LLM(vlm, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)


def test_same_image_hits_the_prefix_cache_and_is_encoded_once(cached_llm, vlm, reference) -> None:
    llm = cached_llm
    cache = llm.engine.runner.images.cache
    ids, images = prompt(llm, vlm, [1])
    first, cached = run(llm, ids, images, rid="a")
    assert cached == 0 and cache.encoded == 1
    again, cached = run(llm, ids, images, rid="b")
    assert again == first
    image_end = images[0].end
    assert cached >= image_end and cached == (len(ids) - 1) // 4 * 4  # every full block
    # the hit served the image's KV: nothing to encode (its tokens were not computed)
    assert cache.encoded == 1
    # another picture at the same place: a miss from the block holding its first token
    other_ids, other = prompt(llm, vlm, [2])
    assert other_ids == ids and other[0].content_hash != images[0].content_hash
    answer, cached = run(llm, other_ids, other, rid="c")
    assert cached == images[0].offset // 4 * 4 and cache.encoded == 2
    assert answer == theirs(reference, other_ids, other, generate=GREEDY.max_tokens)
    # the first picture again with the prefix cache cleared: computed, but not encoded again
    assert llm.engine.reset_prefix_cache()
    third, cached = run(llm, ids, images, rid="d")
    assert third == first and cached == 0 and cache.encoded == 2 and cache.hits == 1


def test_a_prompt_and_its_images_must_agree(cached_llm, vlm) -> None:
    llm = cached_llm
    ids, images = prompt(llm, vlm, [1])
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ParamError, match="placeholder; send the image"):
        llm.engine.validate_prompt(ids, params)  # soft-token positions without their image
    shifted = (dataclasses.replace(images[0], offset=images[0].offset - 1),)
    with pytest.raises(ParamError, match="do not hold its placeholder"):
        llm.engine.validate_prompt(ids, params, shifted)
    text_only = dataclasses.replace(llm.engine.info, image_token_id=None)
    with pytest.raises(ParamError, match="takes text only"):
        text_only.validate(ids, params, images)


def test_a_hit_that_ends_inside_an_image_computes_the_rest_of_it_whole(vlm, reference) -> None:
    """Blocks of 2 tokens; the cached blocks after the one holding the image's first soft token
    are dropped, so the next request's hit ends inside the image: its remaining soft tokens are
    computed in one chunk, attending both ways among themselves and to the cached ones."""
    llm = LLM(vlm, num_kv_blocks=64, block_size=2, max_num_batched_tokens=4)
    ids, images = prompt(llm, vlm, [4])
    first, _ = run(llm, ids, images, rid="a")
    image = images[0]
    keep = image.offset // 2 + 1  # the block holding the first soft token, and those before
    assert image.offset < keep * 2 < image.end - 1  # the hit will end inside the image
    pool = llm.engine.kv.pool
    for block_hash in llm.engine.kv.hasher.hashes(ids, None, images)[keep:]:
        if (block := pool.lookup(block_hash)) is not None:
            pool.forget(block)
    again, cached = run(llm, ids, images, rid="b")
    assert cached == keep * 2
    assert again == first == theirs(reference, ids, images, generate=GREEDY.max_tokens)


def test_preemption_and_the_host_tier_with_images(vlm, reference) -> None:
    """Three image requests in a device pool too small for all: the preempted ones swap to the
    host tier and back (or recompute, images included, encoded once each: the encoder cache
    keeps them) and answer as transformers. Then a picture's blocks are offloaded as an idle
    session's are; the same picture again meets them in the host tier."""
    llm = LLM(vlm, num_kv_blocks=20, block_size=4, max_num_batched_tokens=64, host_bytes="8MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine, wanted, prompts = llm.engine, {}, {}
    for k in range(3):
        prompts[f"p{k}"] = prompt(llm, vlm, [30 + k])
        engine.add_request(f"p{k}", *prompts[f"p{k}"][:1], params, images=prompts[f"p{k}"][1])
        wanted[f"p{k}"] = theirs(reference, *prompts[f"p{k}"], generate=16)
    got: dict[str, list[int]] = {rid: [] for rid in wanted}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            got[out.request_id] += out.new_token_ids
    assert engine.scheduler.num_preemptions > 0
    assert got == wanted
    assert engine.runner.images.cache.encoded == 3
    ids, images = prompt(llm, vlm, [40])
    first, _ = run(llm, ids, images, rid="a")
    # an idle session's offload finds its blocks by the same keys, the picture's content hash
    # among them, and moves every one
    hashes = engine.kv.hasher.hashes(ids, None, images)
    assert all(engine.kv.pool.lookup(h) for h in hashes)
    assert engine.offload_prefix(ids, None, images) == len(hashes)
    assert not any(engine.kv.pool.lookup(h) for h in hashes)
    host_before = engine.kv.hits_by_source["host"]
    again, cached = run(llm, ids, images, rid="b")
    assert again == first and cached == (len(ids) - 1) // 4 * 4
    assert engine.kv.hits_by_source["host"] > host_before
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
