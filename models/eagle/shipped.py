"""The EAGLE heads shipped with kvserve, and how a target model is recognised as the one a head
was trained for: by its weights, not its path or a flag. A head directory may hold
`target_probe.json`, rows of its target's token embeddings; a loaded model whose rows agree
within quantisation error (a BF16, F16, Q8_0 or float32 copy of the same checkpoint, a GGUF or
a safetensors export) gets the head. A different fine-tune moves its embeddings further than
that; and a wrong head would only lower acceptance (verification is lossless)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

HEADS_DIR = Path(__file__).resolve().parent / "heads"
PROBE_FILE = "target_probe.json"
PROBE_ROWS = (0, 1, 2, 100, 1000, 5000, 20000, 40000)
PROBE_COLS = 64
# Q8_0 stores blocks of 32 with a per-block scale: an embedding entry (|x| < ~0.5) moves by
# at most ~0.002; bf16 by 0.4%. A fine-tune moves the rows it has trained far more on average.
MAX_ABS, MAX_MEAN_ABS = 0.02, 0.003


def embedding_probe(embed: torch.Tensor) -> dict:
    rows = [r for r in PROBE_ROWS if r < embed.shape[0]]
    values = embed[rows, :PROBE_COLS].detach().to(torch.float32).cpu()
    return {
        "vocab_size": int(embed.shape[0]),
        "hidden_size": int(embed.shape[1]),
        "rows": rows,
        "values": [[round(v, 6) for v in row] for row in values.tolist()],
    }


def probe_matches(probe: dict, embed: torch.Tensor) -> bool:
    if (probe["vocab_size"], probe["hidden_size"]) != tuple(embed.shape):
        return False
    ours = embed[probe["rows"], :PROBE_COLS].detach().to(torch.float32).cpu()
    diff = (ours - torch.tensor(probe["values"], dtype=torch.float32)).abs()
    return bool(diff.max() <= MAX_ABS and diff.mean() <= MAX_MEAN_ABS)


def shipped_head_for(embed: torch.Tensor) -> str | None:
    """The shipped head directory trained for the model with these token embeddings, if any."""
    for head in sorted(HEADS_DIR.iterdir()) if HEADS_DIR.is_dir() else []:
        probe_path = head / PROBE_FILE
        if probe_path.is_file() and probe_matches(json.loads(probe_path.read_text()), embed):
            return os.fspath(head)
    return None


def write_probe(head_dir: str, embed: torch.Tensor) -> None:
    """Record the target a head was trained for (tools/eagle_train.py's last step)."""
    Path(head_dir, PROBE_FILE).write_text(json.dumps(embedding_probe(embed)) + "\n")
