"""A tiny random Gemma 4 vision-language checkpoint (`Gemma4ForConditionalGeneration`, no audio
tower): a tower of width 32, 2 layers (grouped KV heads, clipped linears, standardised output)
over 2x2-pixel patches pooled 3x3 into soft tokens (a budget of 70), and a 2-layer Gemma 4 text
model (a sliding layer, a global one, per-layer inputs); a byte-level BPE tokenizer knowing the
turn and image tokens."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from tests.vision_model import TEMPLATE, train_tokenizer

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
BOI, EOI, IMAGE = 5, 6, 7
# Gemma 3's turns, an image written as the one token the server widens (Gemma 4's processor:
# begin, the image's soft tokens, end)
GEMMA4_TEMPLATE = TEMPLATE.replace("<start_of_image>", "<image_soft_token>")
PROCESSOR = dict(patch_size=2, max_soft_tokens=70, pooling_kernel_size=3)


def build_gemma4_vlm(out: Path) -> Path:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    s, f = "sliding_attention", "full_attention"
    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        layer_types=[s, f],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=512,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        patch_size=2,
        position_embedding_size=64,
        pooling_kernel_size=3,
        standardize=True,
        use_clipped_linears=True,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMAGE,
    )
    torch.manual_seed(zlib.crc32(b"gemma4-vlm") % 1000)
    model = Gemma4ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):  # Gemma 4 multiplies by the weight
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
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
    train_tokenizer(out, SPECIALS)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<end_of_turn>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": GEMMA4_TEMPLATE,
            }
        )
    )
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma4ImageProcessor",
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": False,
                **PROCESSOR,
            }
        )
    )
    return out
