"""A tiny random Gemma 4 vision-language checkpoint (`Gemma4ForConditionalGeneration`, no audio
tower): a tower of width 32, 2 layers (grouped KV heads, clipped linears, standardised output)
over 2x2-pixel patches pooled 3x3 into soft tokens (a budget of 70), and a 2-layer Gemma 4 text
model (a sliding layer, a global one, per-layer inputs); a byte-level BPE tokenizer knowing the
turn and image tokens."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from tests.conftest import TINY_TEXT, F, S, randomize
from tests.vision_model import (
    BOI,
    EOI,
    IMAGE,
    SPECIALS,
    TEMPLATE,
    TINY_TOWER,
    write_tokenizer_files,
)

# Gemma 3's special tokens (vision_model's SPECIALS, the same ids) and turns, an image written
# as the one token the server widens (Gemma 4's processor: begin, the image's soft tokens, end)
GEMMA4_TEMPLATE = TEMPLATE.replace("<start_of_image>", "<image_soft_token>")
# the tiny Gemma 4 text model (tests/test_gemma4.py's shapes start from it too): a sliding
# layer, then a global one of wider heads; per-layer inputs
GEMMA4_TEXT = TINY_TEXT | dict(
    intermediate_size=96,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    layer_types=[S, F],
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=512,
)
PROCESSOR = dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=3)


def build_gemma4_vlm(out: Path) -> Path:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = TINY_TOWER | dict(
        num_key_value_heads=1,
        head_dim=16,
        position_embedding_size=64,
        standardize=True,
        use_clipped_linears=True,
        # the processor's patches and pooling
        patch_size=PROCESSOR["patch_size"],
        pooling_kernel_size=PROCESSOR["pooling_kernel_size"],
    )
    config = Gemma4Config(
        text_config=GEMMA4_TEXT,
        vision_config=vision,
        audio_config=None,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMAGE,
    )
    torch.manual_seed(zlib.crc32(b"gemma4-vlm") % 1000)
    model = Gemma4ForConditionalGeneration(config).float()
    randomize(model, is_norm=multiplies_by_weight)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):  # bounds some values pass
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.1 * torch.randn_like(b))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "add_bos_token": False}
    image_processor = {
        "image_processor_type": "Gemma4ImageProcessor",
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        **PROCESSOR,
    }
    write_tokenizer_files(out, SPECIALS, GEMMA4_TEMPLATE, tokenizer, image_processor)
    return out


def multiplies_by_weight(name: str) -> bool:
    """Gemma 4's norms and scales: it multiplies by the weight itself, so they are drawn
    around 1 (`randomize`'s norms)."""
    return "norm" in name or name.endswith("scale")
