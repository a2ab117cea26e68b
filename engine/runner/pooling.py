"""Embeddings from a decoder: which pooling a checkpoint asks for, and the pooled vector.

A request whose `SamplingParams.pooling` is set runs its prompt through prefill only (chunked
like any prefill, under the same token budget) and ends, when its prefill reaches the end,
with the pooled final hidden state (after the model's final norm, what transformers' `AutoModel`
returns as `last_hidden_state`), L2-normalised, instead of a sampled token.

- "last": the last prompt token's hidden state (Qwen3-Embedding, gte-Qwen2). The last token is
  always computed (a prefix-cache hit leaves at least it), so prefix hits are fine.
- "mean": the mean over every prompt position. Chunks arrive over several steps, so the engine
  keeps a running float32 sum per request; prefix-cache hits would skip positions, so mean
  pooling requests take none (kv_cache_manager.get_computed_blocks), and a preempted one starts
  its sum again.
"""

from __future__ import annotations

import json
import os

import torch

POOLINGS = ("last", "mean")

# sentence-transformers' 1_Pooling/config.json keys
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def resolve_pooling(model_path: str, flag: str = "auto") -> str:
    """`flag` ("last" | "mean"), or with "auto" what the checkpoint's sentence-transformers
    pooling config says (`1_Pooling/config.json`, found through `modules.json` when present);
    "last" when it says nothing we serve (a plain generator: its last token sees the whole
    input)."""
    if flag in POOLINGS:
        return flag
    if flag != "auto":
        raise ValueError(f"pooling must be auto, last or mean; got {flag!r}")
    if not os.path.isdir(model_path):
        return "last"
    for sub in _pooling_dirs(model_path):
        path = os.path.join(model_path, sub, "config.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            cfg = json.load(f)
        for key, mode in _ST_MODES.items():
            if cfg.get(key):
                return mode
    return "last"


def _pooling_dirs(model_path: str) -> list[str]:
    dirs = ["1_Pooling"]
    modules = os.path.join(model_path, "modules.json")
    if os.path.isfile(modules):
        with open(modules) as f:
            for module in json.load(f):
                if str(module.get("type", "")).endswith("Pooling") and module.get("path"):
                    dirs.insert(0, module["path"])
    return dirs


def normalize(vector: torch.Tensor) -> torch.Tensor:
    """float32 and unit L2 norm (a zero vector stays zero)."""
    return torch.nn.functional.normalize(vector.float(), dim=-1)
