"""A random-weight checkpoint with a real vision-language model's geometry, for benchmarks on a
machine without a model hub: `google/gemma-3-4b-it`'s config.json written out by hand (the
keys it names; transformers' defaults give the rest, as they do for the real one), bfloat16
weights drawn at a small scale so activations stay finite, and the tests' byte-level tokenizer
and processor files (tests/vision_model.py) sized for its 896x896 pictures of 256 soft tokens.

The vocabulary is the tests' synthetic one (512 rows, 400 of them trained), not Gemma's 262,208:
there is no Gemma tokenizer here, and rows no tokenizer can decode would make the answers
undecodable. The embedding and the tied head shrink (~0.67 B of the 4.3 B parameters, only the
last position's head in a prefill); everything else (34 decoder layers of width 2560, the
27-layer SigLIP tower, the projector) is the real shape.

    python -m bench.random_vlm /tmp/gemma3-4b-random   # ~7.3 GB of safetensors"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# google/gemma-3-4b-it's config.json, its keys as published; the vocabulary and token ids
# are the synthetic tokenizer's (tests/vision_model.py's `gemma3_vlm_config`: 512 rows; Gemma's
# image tokens are 255999, 256000 and 262144)
GEMMA3_4B_TEXT = dict(
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=34,
    rope_scaling={"factor": 8.0, "rope_type": "linear"},
    sliding_window=1024,
)
GEMMA3_4B_VISION = dict(
    hidden_size=1152,
    image_size=896,
    intermediate_size=4304,
    num_attention_heads=16,
    num_hidden_layers=27,
    patch_size=14,
    vision_use_head=False,
)
GEMMA3_4B_SOFT_TOKENS = 256
INIT_STD = 0.02  # the config's initializer_range


def build_gemma3_4b(out: Path) -> Path:
    """`out` with Gemma 3 4B's geometry in random bfloat16 weights, its tokenizer and processor
    files; kept when `out` already holds them (building it costs minutes; the processor
    config is written last)."""
    if (out / "preprocessor_config.json").exists():
        return out
    sys.path.insert(0, str(ROOT))  # the tests' tokenizer builder, from the checkout's root
    from transformers import Gemma3ForConditionalGeneration

    from tests.vision_model import gemma3_vlm_config, write_gemma3_processor

    config = gemma3_vlm_config(GEMMA3_4B_TEXT, GEMMA3_4B_VISION, GEMMA3_4B_SOFT_TOKENS)
    # shapes first (no memory), then one bfloat16 copy filled in place: ~2 bytes a parameter
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    torch.manual_seed(zlib.crc32(b"gemma3-4b-random") % 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:  # SigLIP's LayerNorms: 1 and 0
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif "norm" in name or name.endswith("bias"):  # Gemma's (1 + w) RMSNorms; biases
                p.zero_()
            else:
                p.normal_(0.0, INIT_STD)
    model.tie_weights()  # to_empty gave the tied head a tensor of its own
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    write_gemma3_processor(out, GEMMA3_4B_SOFT_TOKENS, image_size=GEMMA3_4B_VISION["image_size"])
    saved = json.loads((out / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "bfloat16", saved.get("dtype")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    print(build_gemma3_4b(args.out))


if __name__ == "__main__":
    main()
