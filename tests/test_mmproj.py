"""Gemma 3 served from GGUF files as llama.cpp ships it (issue #71): the text model's GGUF and
the mmproj projector file, both written from the tiny random Gemma 3 vision model as
`convert_hf_to_gguf.py` writes them (tests/gguf_export.py, tests/mmproj_export.py), answer a
prompt with one image as transformers does on the HF checkpoint: logits and greedy text through
the engine, the answer over HTTP with the openai SDK. A text GGUF without `<image_soft_token>`
(as llama.cpp's converter leaves Gemma 3's) serves too, with an unused vocabulary entry at the
image's positions; a Q8_0 projector's soft tokens stay close; mismatched files are refused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from models.image_processor import content_hash, decode_image
from server.errors import APIError
from server.flow.images import LoadedImage, place_images
from tests.gguf_export import write_gguf
from tests.mmproj_export import write_mmproj
from tests.vision_model import IMAGE, TOKENS_PER_IMAGE, build_gemma3_vlm, data_url, png

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# the prompt as Gemma 3's chat template renders one user turn with an image before its text
TEXT = (
    "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
)
# no startup measurements (step budget, packed weights, speculation costs): seconds each here
ENGINE = dict(
    num_kv_blocks=64,
    block_size=4,
    max_num_batched_tokens=64,
    target_step_ms=-1,
    cpu_packed_weights=False,
    spec_cost_model=False,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3-mmproj")
    vlm = build_gemma3_vlm(root / "vlm", text_layers=6)  # llama.cpp's Gemma 3 layer pattern
    return {
        "vlm": vlm,
        "text": write_gguf(vlm, root / "text.gguf"),
        # llama.cpp's converter drops Gemma 3's soft token from the vocabulary (#12876)
        "text_no_soft": write_gguf(
            vlm, root / "text-no-soft.gguf", unused_tokens=("<image_soft_token>",)
        ),
        "mmproj": write_mmproj(vlm, root / "mmproj-f32.gguf", "F32"),
    }


@pytest.fixture(scope="module")
def reference(files):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(files["vlm"], dtype=torch.float32)
    # the converter stores the input projection in F16 whatever the output type: the same
    # numbers here, so the comparison measures the serving path and not that rounding
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    proj.data = proj.data.half().float()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def placed(llm: LLM, seed: int):
    """The prompt's ids and image as the server places them (server/flow/images.py)."""
    engine = llm.engine
    assert engine.image_processor is not None and engine.vision is not None
    pixels = engine.image_processor(decode_image(png(seed), 10**7, 2))
    image = LoadedImage(pixels, content_hash(pixels))
    return place_images(llm.tokenizer, engine.vision, TEXT, [image], "messages")


def test_text_gguf_and_mmproj_answer_as_transformers(files, reference) -> None:
    """The vocabulary without the soft token: its placeholder is an unused entry inside the
    vocabulary, read as one token; the ids elsewhere are the HF tokenizer's."""
    llm = LLM(str(files["text_no_soft"]), mmproj=str(files["mmproj"]), **ENGINE)
    vision, vocab = llm.engine.vision, llm.engine.spec.vocab_size
    assert vision is not None and vision.tokens_per_image == TOKENS_PER_IMAGE
    assert 0 <= vision.image_token_id < vocab and llm.tokenizer.id_to_token(IMAGE) == "[PAD7]"
    ids, images = placed(llm, 1)
    soft = "<image_soft_token>" * TOKENS_PER_IMAGE
    expanded = TEXT.replace("<start_of_image>", f"\n\n<start_of_image>{soft}<end_of_image>\n\n")
    theirs_ids = HFTokenizer.from_file(str(files["vlm"] / "tokenizer.json")).encode(expanded).ids
    assert ids == [IMAGE if t == vision.image_token_id else t for t in theirs_ids]
    kw = dict(
        input_ids=torch.tensor([theirs_ids]),
        pixel_values=images[0].pixels[None],
        token_type_ids=torch.tensor([[int(t == IMAGE) for t in theirs_ids]]),
    )
    with torch.no_grad():
        ref = reference(**kw).logits[0]
        wanted = reference.generate(**kw, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    ours = score_prompt(llm.engine, ids, images=images)
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    llm.engine.add_request("r", ids, GREEDY, images=images)
    tokens: list[int] = []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    assert tokens == wanted[0, len(ids) :].tolist()
    # the entry's text from a client is the placeholder's: refused, not read as an image
    with pytest.raises(APIError, match="image placeholder token"):
        image = LoadedImage(images[0].pixels.numpy(), images[0].content_hash)
        place_images(llm.tokenizer, vision, TEXT + "[PAD7]", [image], "messages")
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


@pytest.mark.slow  # starts a server
def test_chat_over_http_with_the_openai_sdk(files, reference) -> None:
    """The vocabulary with `<image_soft_token>`; the chat route renders the GGUF's template."""
    from openai import OpenAI
    from PIL import Image
    from transformers import AutoProcessor

    from models.tokenizer import load_tokenizer
    from tests.server_utils import InProcessServer

    processor = AutoProcessor.from_pretrained(files["vlm"])
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=[Image.open(io.BytesIO(png(5)))], return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False)
    # decoded by the GGUF's own vocabulary, as the server decodes (a random model may answer
    # with ids past the HF tokenizer's, which the GGUF names [PAD<id>])
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    # (the server holds back a trailing incomplete UTF-8 sequence, shown here as U+FFFD)
    wanted = load_tokenizer(str(files["text"])).decode(new).rstrip("\ufffd")
    server = InProcessServer(
        files["text"], engine={**ENGINE, "mmproj": str(files["mmproj"])}, served_model_name="gemma3"
    )
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="gemma3",
            max_tokens=6,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(png(5))}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        assert reply.choices[0].message.content == wanted
        assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
        assert reply.usage.completion_tokens == len(new)
    finally:
        server.stop()


def test_a_q8_0_projector_is_close(files, reference, tmp_path) -> None:
    """Matrices in Q8_0 blocks, dequantized at load: soft tokens within Q8_0's rounding of
    transformers' image features."""
    from models.mmproj import load_mmproj_encoder, mmproj_vision_spec
    from models.spec import ModelSpec

    q8 = write_mmproj(files["vlm"], tmp_path / "mmproj-q8.gguf", "Q8_0")
    vision = mmproj_vision_spec(str(q8), str(files["text"]))
    spec = ModelSpec("Gemma3ForCausalLM", 512, 64, (), vision=vision)
    encoder, processor = load_mmproj_encoder(str(q8), spec, torch.float32, "cpu")
    pixels = torch.from_numpy(processor(decode_image(png(2), 10**7, 2)))[None]
    with torch.no_grad():
        ref = reference.get_image_features(pixel_values=pixels)
    ref = getattr(ref, "pooler_output", ref)
    ours = encoder(pixels)
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert 1e-6 < err < 3e-2, err  # rounded (not the F32 numbers), and within Q8_0's error


@pytest.mark.parametrize(
    "case, match",
    [
        ("qwen2vl", "projector type 'qwen2vl' is not served.*qwen2vl"),
        ("width", "projects images to width 48.*64 wide"),
        ("hf_dir", "goes with a GGUF text model"),
        ("llama_text", "beside a gemma3 text GGUF.*'llama'"),
    ],
)
def test_mismatched_files_are_refused_at_startup(files, tmp_path, case: str, match: str) -> None:
    vlm, text, mmproj = files["vlm"], files["text"], files["mmproj"]
    if case == "qwen2vl":
        mmproj = write_mmproj(vlm, tmp_path / "qwen.gguf", "F32", projector_type="qwen2vl")
    elif case == "width":
        mmproj = write_mmproj(vlm, tmp_path / "narrow.gguf", "F32", projection_dim=48)
    elif case == "hf_dir":
        text = vlm
    else:
        from models.loader import default_model_path

        text = Path(default_model_path())  # the shipped SmolLM2 GGUF: a llama
    with pytest.raises(ValueError, match=match):
        LLM(str(text), mmproj=str(mmproj), **ENGINE)
