"""Whether the sliding-window layers' KV gets a pool of its own (engine/kv/window.py), and its
size: decided once at startup, from the model, the chosen attention backend and the tiers."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.kv.window import window_pool_blocks
from models.spec import ModelSpec


def windowed_groups(spec: ModelSpec) -> set[int] | None:
    """The KV groups whose layers all attend over the window; None where a group is shared by
    windowed and full-context layers (its blocks would be needed whole)."""
    windowed: dict[int, bool] = {}
    for i, lay in enumerate(spec.layers):
        w = spec.layer_window(i) is not None
        if windowed.setdefault(lay.kv_group, w) != w:
            return None
    return {g for g, w in windowed.items() if w}


def reclaim_refusal(
    config: EngineConfig,
    spec: ModelSpec,
    backend_cls: type[AttentionBackend],
    max_model_len: int,
    tensor_parallel: bool,
    draft_head: bool,
) -> str | None:
    """Why the windowed layers keep KV for every token; None: their blocks behind the window go
    back to a pool of their own. Each reason is a path that moves or reads one block id across
    every KV group."""
    window, groups = spec.sliding_window, windowed_groups(spec)
    if groups is None:
        return "a KV group shared by windowed and full-context layers"
    if window is None or not groups:
        return "no sliding-window layers"
    if window >= max_model_len:
        return f"the window ({window}) spans the whole context ({max_model_len})"
    if not config.reclaim_window_blocks:
        return "--no-reclaim-window-blocks"
    if not backend_cls.reads_window_tables:
        return f"the {backend_cls.name} backend reads one block table per step"
    if tensor_parallel:
        return "tensor parallelism (the ranks' steps carry one block table)"
    if draft_head:
        return "a draft head (its catch-up reads the target's block table)"
    if config.enable_prefix_caching and config.host_tier_bytes() > 0:
        return "the host tier (it copies a block id across every KV group)"
    return None


def window_blocks_for(
    config: EngineConfig, spec: ModelSpec, block_size: int, cap: int, seqs: int | None = None
) -> int:
    """The window pool's blocks: every running sequence's window (`seqs` of them, default
    max_num_seqs) and a step's new tokens."""
    assert spec.sliding_window is not None
    seqs = config.max_num_seqs if seqs is None else seqs
    return window_pool_blocks(
        seqs, spec.sliding_window, block_size, config.max_num_batched_tokens, cap
    )


def scratch_blocks(num_blocks: int, window_blocks: int) -> int:
    """Blocks a startup forward may write (ids below this exist in every KV group: the window
    pool, where there is one, is the smaller)."""
    return min(num_blocks, window_blocks) if window_blocks else num_blocks


def block_bytes(spec: ModelSpec, dtype_size: float, block_size: int) -> tuple[int, int]:
    """(bytes of a block in the full-context groups, in the windowed groups)."""
    windowed = windowed_groups(spec) or set()
    full = win = 0
    for g, group in enumerate(spec.kv_layouts):
        size = round(group.block_values(block_size) * dtype_size)
        if g in windowed:
            win += size
        else:
            full += size
    return full, win
