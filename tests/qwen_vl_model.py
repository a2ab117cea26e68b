"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints (`Qwen2_5_VLForConditionalGeneration`: a
3-block tower of width 32 over 4-pixel patches merged 2x2, windows of 2x2 merged patches beside
one full-attention block; a 2-layer Qwen2 text model with M-RoPE sections (2, 3, 3); Qwen3-VL's
in `build_qwen3_vl`), each with a byte-level BPE tokenizer that knows Qwen's turn and vision
tokens, a Qwen-shaped chat template and a processor config whose pixel bounds give small images
a few soft tokens."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from tests.conftest import TINY_TEXT, randomize
from tests.vision_model import RESIZE_RESCALE_NORMALIZE, write_tokenizer_files

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 3, 4, 5, 6
PATCH, MERGE = 4, 2
# Qwen2.5-VL's template, system prompt and tools left out: an image item is the block the
# processor widens (one <|image_pad|> per merged patch)
TEMPLATE = "".join(
    [
        "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' }}",
        "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}",
        "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}",
        "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}",
        "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}{%- endfor -%}",
        "{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}",
    ]
)


TEXT = TINY_TEXT | dict(bos_token_id=0)
# both towers: 3 blocks of width 32 over 4-pixel patches (2 frames), merged 2x2 and projected
# to the text model's width
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=TEXT["hidden_size"],
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
TOKEN_IDS = dict(
    image_token_id=IMAGE_PAD,
    video_token_id=VIDEO_PAD,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)


def build_qwen25_vl(out: Path) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = TEXT | dict(rope_parameters=MROPE)
    vision = VISION | dict(window_size=16, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **TOKEN_IDS)
    return _save(
        Qwen2_5_VLForConditionalGeneration, config, out, b"qwen2.5-vl", "Qwen2_5_VLProcessor"
    )


def build_qwen3_vl(out: Path) -> Path:
    """Qwen3-VL's shape of the same: a 2-layer Qwen3 text model (q/k norms, head 16) with
    interleaved M-RoPE sections (2, 3, 3); a 3-block tower (LayerNorm, tanh-GELU MLP, patch
    embedding with a bias) with a learned 4x4 position grid interpolated to each image, and
    deepstack mergers after blocks 0 and 2, added after decoder layers 0 and 1."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = TEXT | dict(head_dim=16, rope_parameters=MROPE | {"mrope_interleaved": True})
    vision = VISION | dict(
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
        hidden_act="gelu_pytorch_tanh",
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **TOKEN_IDS)
    return _save(Qwen3VLForConditionalGeneration, config, out, b"qwen3-vl", "Qwen3VLProcessor")


def _save(model_class, config, out: Path, seed: bytes, processor_class: str) -> Path:
    """Random weights (norms near 1, the rest wide), the checkpoint, the tokenizer, the chat
    template and a processor config whose pixel bounds give small images a few soft tokens."""
    torch.manual_seed(zlib.crc32(seed) % 1000)
    model = model_class(config).float()
    randomize(model, is_norm=lambda name: "norm" in name or "ln_q" in name)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "processor_class": processor_class,
        "extra_special_tokens": {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    }
    image_processor = RESIZE_RESCALE_NORMALIZE | {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 8 * 8, "longest_edge": 48 * 48},
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
    }
    write_tokenizer_files(out, SPECIALS, TEMPLATE, tokenizer, image_processor)
    return out
