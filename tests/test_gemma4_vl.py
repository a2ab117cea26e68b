"""Gemma 4 with images through the engine (issue #71), against transformers float32 on a tiny
random `Gemma4ForConditionalGeneration`: the processor's patches and soft-token count, the
image encoder's soft tokens, logits and greedy text for a prompt with one image (prefilled
in chunks that split it), the same picture twice a prefix hit encoded once, the server's widening
of the chat template's placeholder, the chat and Messages routes with the `openai` and
`anthropic` SDKs; with the text config's two-way image attention ("vision":
on the sliding-window layers only) the same against transformers' mask; "all" refused."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.images import PromptImage
from models.gemma4_image_processor import Gemma4ImageProcessor
from models.image_processor import content_hash, decode_image
from models.loader import hf_spec
from server.flow.images import LoadedImage, place_images
from tests.gemma4_vl_model import IMAGE, PROCESSOR, build_gemma4_vlm
from tests.vision_model import (
    assert_like_reference,
    greedy_reference,
    png,
    reference_run,
    run_request,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    return str(build_gemma4_vlm(tmp_path_factory.mktemp("gemma4-vlm") / "vlm"))


@pytest.fixture(scope="module")
def reference(vlm):  # transformers' float32 model
    model = greedy_reference("Gemma4ForConditionalGeneration", vlm)
    assert model.config.audio_config is None
    return model


def their_inputs(seed: int) -> dict:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = decode_image(png(seed), 10**7, 2)
    return Gemma4ImageProcessorPil(**PROCESSOR)(images=[image], return_tensors="pt")


def prompt(llm: LLM, vlm: str, seed: int):
    """A user turn with one image, widened as Gemma 4's processor does (begin, placeholders,
    end), and the image at its soft tokens."""
    vision = hf_spec(vlm).vision
    processor = Gemma4ImageProcessor.read(vlm, vision.tower_config)
    patches, grid = processor.process(decode_image(png(seed), 10**7, 2))
    n = grid[1] * grid[2] // 9
    text = "<bos><start_of_turn>user\n<start_of_image>" + "<image_soft_token>" * n
    text += "<end_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    at = ids.index(IMAGE)
    pixels = torch.from_numpy(patches)
    image = PromptImage(at, n, content_hash(patches, grid), pixels, grid, vision.two_way)
    return ids, (image,)


def theirs(reference, seed: int, ids, images, generate: int = 0):
    inputs = their_inputs(seed)
    kw = dict(
        input_ids=torch.tensor([ids]),
        pixel_values=inputs["pixel_values"],
        image_position_ids=inputs["image_position_ids"],
    )
    return reference_run(reference, kw, len(ids), generate)


def test_patches_match_transformers_pil_processor(vlm) -> None:
    tower = hf_spec(vlm).vision.tower_config
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    for seed, size in ((3, (53, 17)), (4, (40, 30)), (5, (9, 120))):
        image = decode_image(png(seed, size), 10**7, 2)
        patches, grid = Gemma4ImageProcessor.read(vlm, tower).process(image)
        ref = Gemma4ImageProcessorPil(**PROCESSOR)(images=[image], return_tensors="np")
        n = patches.shape[0]
        assert ref["num_soft_tokens_per_image"][0] == n // 9 == grid[1] * grid[2] // 9
        assert (ref["image_position_ids"][0, n:] == -1).all()  # the rest is padding
        assert abs(ref["pixel_values"][0, :n] - patches).max() < 1e-6


def test_one_image_matches_transformers_and_is_a_prefix_hit(vlm, reference) -> None:
    # chunks of 32 tokens: a causal image may be split between them
    llm = LLM(vlm, num_kv_blocks=96, block_size=4, max_num_batched_tokens=32)
    ids, images = prompt(llm, vlm, 1)
    assert 32 < images[0].num_tokens
    inputs = their_inputs(1)  # the encoder's soft tokens are transformers' image features
    with torch.no_grad():
        ref_soft = reference.model.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"]
        ).pooler_output[0]
    soft = llm.engine.runner.images.model.encode([images[0].pixels], [images[0].grid])[0]
    assert (soft - ref_soft).abs().max().item() < 1e-4 * ref_soft.abs().max().item()
    assert_like_reference(llm, ids, images, partial(theirs, reference, 1), GREEDY)
    # the same picture again: its blocks are a prefix hit past the image, encoded once
    cache = llm.engine.runner.images.cache
    encoded = cache.encoded
    first, _ = run_request(llm, ids, images, GREEDY, rid="a")
    again, cached = run_request(llm, ids, images, GREEDY, rid="b")
    assert again == first and cached == (len(ids) - 1) // 4 * 4 and cached > images[0].end
    assert cache.encoded == encoded
    # the server widens the chat template's placeholder as Gemma 4's processor does
    rendered = "<bos><start_of_turn>user\n<image_soft_token>What is this?<end_of_turn>\n"
    rendered += "<start_of_turn>model\n"
    loaded = LoadedImage(images[0].pixels.numpy(), images[0].content_hash, images[0].grid)
    placed_ids, placed = place_images(llm.tokenizer, hf_spec(vlm).vision, rendered, [loaded], "m")
    assert placed_ids == ids and placed[0].offset == images[0].offset
    assert placed[0].num_tokens == images[0].num_tokens and not placed[0].two_way


@pytest.fixture(scope="module")
def two_way_vlm(vlm, tmp_path_factory) -> str:
    """The same weights, the text config asking for two-way attention among an image's tokens
    (on the sliding-window layers only, as Gemma 4 applies it)."""
    other = tmp_path_factory.mktemp("gemma4-vlm-two-way") / "vlm"
    shutil.copytree(vlm, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    (other / "config.json").write_text(json.dumps(cfg))
    return str(other)


def test_two_way_images_on_sliding_layers_match_transformers(two_way_vlm) -> None:
    reference = greedy_reference("Gemma4ForConditionalGeneration", two_way_vlm)
    # chunks of 64: the first stops before the image, which the next takes whole
    llm = LLM(two_way_vlm, num_kv_blocks=96, block_size=4, max_num_batched_tokens=64)
    ids, images = prompt(llm, two_way_vlm, 1)
    assert images[0].two_way
    type_ids = torch.tensor([[int(t == IMAGE) for t in ids]])

    def theirs_two_way(ids, images, generate: int = 0):
        inputs = their_inputs(1)
        kw = dict(
            input_ids=torch.tensor([ids]),
            pixel_values=inputs["pixel_values"],
            image_position_ids=inputs["image_position_ids"],
            mm_token_type_ids=type_ids,
        )
        return reference_run(reference, kw, len(ids), generate)

    ref = assert_like_reference(llm, ids, images, theirs_two_way, GREEDY)
    causal = theirs(reference, 1, ids, images)  # without the image's token types: causal
    assert (causal - ref).abs().max().item() > 1e-3  # the two-way span matters
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_a_text_model_attending_both_ways_is_refused(vlm, tmp_path) -> None:
    other = tmp_path / "all"
    shutil.copytree(vlm, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "all"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a causal decoder"):
        hf_spec(str(other))


def test_chat_and_messages_answer_an_image_as_transformers(vlm, reference) -> None:
    """One picture through HTTP: an `openai` chat `image_url` part and an `anthropic` Messages
    `image` block answer with transformers' greedy text on the prompt the template and the
    server's widening build (the engine test's prompt)."""
    from transformers import AutoTokenizer

    from tests.server_utils import InProcessServer
    from tests.test_vision_server import messages_image, openai_client
    from tests.vision_model import data_url

    server = InProcessServer(vlm, engine={"block_size": 4, "target_step_ms": -1})
    try:
        ids, images = prompt(server.core, vlm, 1)
        tokens = theirs(reference, 1, ids, images, generate=GREEDY.max_tokens)
        text = AutoTokenizer.from_pretrained(vlm).decode(tokens, skip_special_tokens=True)
        answer = text.rstrip("\ufffd")  # the server holds an unfinished UTF-8 tail back
        question = [{"type": "text", "text": "What is this?"}]
        extra = {"ignore_eos": True, "temperature": 0.0}
        r = openai_client(server).chat.completions.create(
            model="vlm",
            max_tokens=GREEDY.max_tokens,
            extra_body=extra,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(png(1))}}]
                    + question,
                }
            ],
        )
        assert r.choices[0].message.content == answer
        assert r.usage.prompt_tokens == len(ids)
        msg = messages_image(server, png(1), "What is this?", GREEDY.max_tokens, ignore_eos=True)
        assert "".join(b.text for b in msg.content if b.type == "text") == answer
    finally:
        server.stop()
