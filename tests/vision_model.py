"""A tiny random Gemma 3 vision-language checkpoint (`Gemma3ForConditionalGeneration`: SigLIP
tower of width 32 and 2 layers over 28x28 images in 7x7 patches, 4 soft tokens an image, a
2-layer text model with a sliding window of 8 beside a global layer), with a byte-level BPE
tokenizer that knows Gemma's turn and image tokens and a Gemma-shaped chat template; and small
PNG images to send it."""

from __future__ import annotations

import base64
import io
import json
import zlib
from pathlib import Path

import numpy as np
import torch

from tests.conftest import CORPUS, TINY_TEXT, TOKENIZER_IDS

SPECIALS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
BOI, EOI, IMAGE = 5, 6, 7  # their ids (trained first, in this order)
TOKENS_PER_IMAGE = 4
# the vision tower's size, here and in Gemma 4's (tests/gemma4_vl_model.py)
TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
# an image processor's steps, Gemma 3's and Qwen's alike: RGB, resized, scaled to [0, 1] and
# normalised by the processor's own mean and std
RESIZE_RESCALE_NORMALIZE = {
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
}
# Gemma 3's template, its system-prompt merging left out: an image item is <start_of_image>,
# which the processor widens into the image's soft tokens
TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_gemma3_vlm(out: Path, text_layers: int = 2) -> Path:
    """`text_layers` 6: llama.cpp's fixed Gemma 3 pattern (five windowed, then a global one),
    the only one a GGUF can say; 2: one of each."""
    from transformers import Gemma3ForConditionalGeneration

    kinds = ["sliding_attention"] * (text_layers - 1) + ["full_attention"]
    text = TINY_TEXT | dict(
        num_hidden_layers=text_layers,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=kinds,
    )
    vision = TINY_TOWER | dict(image_size=28, patch_size=7, vision_use_head=False)
    config = gemma3_vlm_config(text, vision, TOKENS_PER_IMAGE)
    torch.manual_seed(zlib.crc32(b"gemma3-vlm") % 1000)
    model = Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "layer_norm" not in name and "layernorm" not in name:
                p.copy_(0.1 * torch.randn_like(p))  # Gemma's (1 + w) norms
            elif "layer_norm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    write_gemma3_processor(out, TOKENS_PER_IMAGE, image_size=28)
    return out


def gemma3_vlm_config(text: dict, vision: dict, tokens_per_image: int):
    """A `Gemma3Config` of the `text` and `vision` towers over the synthetic tokenizer: its rows,
    special ids and image tokens (`text` may name its own)."""
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=TOKENIZER_IDS | text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )


def write_gemma3_processor(out: Path, tokens_per_image: int, image_size: int) -> None:
    """Beside a Gemma 3 VLM checkpoint in `out`: the tokenizer files (`write_tokenizer_files`,
    `SPECIALS` first) and the processor configs for square `image_size` pictures of
    `tokens_per_image` soft tokens each."""
    # what transformers' Gemma3Processor reads too (the tests' reference for the prompt)
    tokenizer = {
        "bos_token": "<bos>",
        "eos_token": "<end_of_turn>",
        "add_bos_token": False,
        "processor_class": "Gemma3Processor",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    }
    image_processor = RESIZE_RESCALE_NORMALIZE | {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        # as Gemma 3's own (llama.cpp's converter reads it)
        "image_seq_length": tokens_per_image,
    }
    write_tokenizer_files(out, SPECIALS, TEMPLATE, tokenizer, image_processor)
    (out / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "Gemma3Processor",
                "image_seq_length": tokens_per_image,
            }
        )
    )


def write_tokenizer_files(
    out: Path, specials: list[str], template: str, tokenizer: dict, image_processor: dict
) -> None:
    """Beside a VLM checkpoint in `out`: the byte-level tokenizer (`specials` first), its config
    (`tokenizer`'s fields, the fast tokenizer's class, the chat `template`), the template in a
    file of its own as transformers' processors save it, and the image processor's config."""
    train_tokenizer(out, specials)
    config = tokenizer | {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(template)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor))


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A random RGB picture, PNG-encoded (resized to the tower's 28x28 by the processor)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def train_tokenizer(out: Path, specials: list[str]) -> None:
    """A byte-level BPE tokenizer over the test corpus, its special tokens trained first (ids
    0, 1, ... in order), saved as `out`/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert [tok.token_to_id(t) for t in specials] == list(range(len(specials)))
    tok.save(str(out / "tokenizer.json"))


def greedy_reference(architecture: str, path: str):
    """transformers' `architecture` model from `path`, float32, generating without an EOS."""
    import transformers

    model = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def reference_run(reference, kw: dict, prompt_len: int, generate: int = 0):
    """transformers' float32 logits of the prompt [tokens, vocab], or its `generate` greedy
    tokens after it, from the model inputs `kw`."""
    with torch.no_grad():
        if generate:
            out = reference.generate(**kw, max_new_tokens=generate, do_sample=False)
            return out[0, prompt_len:].tolist()
        return reference(**kw).logits[0]


def assert_like_reference(llm, ids: list[int], images, theirs, params) -> torch.Tensor:
    """The prompt's logits (scored in one step) and its greedy tokens (under `params`) equal
    transformers' (`theirs(ids, images, generate=n)`); returns transformers' logits."""
    from engine.core.scoring import score_prompt

    ref = theirs(ids, images)
    ours = score_prompt(llm.engine, ids, images=images)
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    tokens, _ = run_request(llm, ids, images, params)
    assert tokens == theirs(ids, images, generate=params.max_tokens)
    return ref


def run_request(llm, ids: list[int], images, params, rid: str = "r") -> tuple[list[int], int]:
    """A request with images through the engine to its end: its tokens and cached tokens."""
    engine = llm.engine
    engine.add_request(rid, ids, params, images=images)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached
