"""Which form serves DeepSeek V4's decode-step work on CPU: its PyTorch ops (the reference) or
kvserve's C++ ops (kernels/deepseek_v4.cpp), timed at startup on this model's geometry, each
part on its own: the hyper-connection mixing (Sinkhorn projection, collapse, expansion), the
RMSNorm + rotary of the attention's queries, key and output (every row, prefill too), and the
decode rows' attention of each layer type (CSA: window + the indexer's top k of the compressed
entries; HCA: window + every entry; sliding: the window alone).

Measured, as every kernel choice is: at one decode row a mixing is ~120 dispatches of [1, 4, 4]
tensors, where the C++ op is one; at many rows with long contexts the PyTorch attention gathers
every entry, where the op reads the indexer's keys and only the entries it keeps. Neither ratio
is known on a CPU before it is timed, and the banner says which serves and by what times.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from models.deepseek_v4_attention import CSA, HCA, SLIDING, V4Attention
from models.deepseek_v4_mix import HyperConnection, fused_refusal
from models.deepseek_v4_plan import Keys

# the context every timed decode row reads (its entries: CONTEXT / m), fewer where the model's
# own limit is shorter; the rows of one step: 1 and the engine's max_num_seqs, at most MAX_ROWS
# (the PyTorch form's gather grows with rows x entries: a bound on the startup's time)
CONTEXT, MAX_ROWS = 4096, 64
REPEATS = 4  # interleaved, the first a warm-up; each form keeps its best
# by geometry: an engine built again in this process reuses the verdicts
_CHOSEN: dict[tuple, tuple[bool, str]] = {}


def decode_inputs(
    attn: V4Attention, rows: int, context: int, block_size: int, seed: int = 0
) -> tuple:
    """Synthetic decode inputs for `attn.attend` / `attn.decode_fused`: `rows` queries at
    lengths from `context` down to about half of it, each over its window and (CSA, HCA) its
    compressed entries in planes shaped as the pool's ([1, 1, blocks, slots, width]). Every row
    reads the same blocks (one sequence's worth of memory, not `rows`)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([context - r * (context // (2 * rows)) for r in range(rows)])
    blocks = -(-context // block_size)
    window = torch.randn(1, 1, blocks, block_size, attn.hd, generator=g)
    q = torch.randn(rows, attn.heads, attn.hd, generator=g)
    span = max(attn.window, 1)  # the decode row at position length - 1 and its window
    pos = lengths[:, None] - span + torch.arange(span)[None, :]
    win = Keys(pos.clamp(0) // block_size, pos.clamp(0) % block_size, pos >= 0)
    if attn.kind == SLIDING:
        return q, window, win, None, None, None, None
    m = attn.m
    width = attn.hd + (attn.index_dim if attn.kind == CSA else 0)
    cache = torch.randn(1, 1, blocks, max(1, block_size // m), width, generator=g)
    counts = lengths // m
    ws = torch.arange(int(counts.max()))[None, :]
    last = (ws + 1) * m - 1
    # as the step's plan: an entry's slot [1, E] is every row's, its block [rows, E] per row
    ent = Keys(
        (last // block_size).expand(rows, -1), (last % block_size) // m, ws < counts[:, None]
    )
    if attn.kind != CSA:
        return q, window, win, cache, ent, None, None
    iq = torch.randn(rows, attn.index_heads, attn.index_dim, generator=g)
    iw = torch.randn(rows, attn.index_heads, generator=g) * attn.index_heads**-0.5
    return q, window, win, cache, ent, iq, iw


def _best_ms(forms: dict[str, Callable[[], object]]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(REPEATS):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts[1:]) * 1e3 for name, ts in times.items()}


def _judge(
    label: str,
    key: tuple,
    forms_at: Callable[[int], dict[str, Callable[[], object]]],
    rows: tuple[int, ...],
) -> tuple[bool, str]:
    """The C++ op serves where it is at least as fast as PyTorch at every row count."""
    if key not in _CHOSEN:
        ms = {r: _best_ms(forms_at(r)) for r in rows}
        fused = all(t["C++"] <= t["PyTorch"] for t in ms.values())
        timed = ", ".join(
            f"{r} row{'s' * (r > 1)} PyTorch {t['PyTorch']:.3f} / C++ {t['C++']:.3f} ms"
            for r, t in ms.items()
        )
        _CHOSEN[key] = fused, f"{label}: {'the C++ op' if fused else 'PyTorch'} ({timed})"
    return _CHOSEN[key]


@torch.inference_mode()
def choose_v4_kernels(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
    block_size: int,
    max_len: int,
) -> str:
    """Time both forms of each part on this model's geometry and set each module's `fused`;
    returns the kernel matrix's line ("" for a model without V4's layers)."""
    mixers = [m for m in model.modules() if isinstance(m, HyperConnection) and m.scale.numel() == 3]
    attns = [m for m in model.modules() if isinstance(m, V4Attention)]
    if not mixers or not attns:
        return ""
    refusal = fused_refusal(dtype, device)
    if refusal is not None:
        return f"PyTorch ({refusal})"
    rows = tuple(sorted({1, min(max(1, max_rows), MAX_ROWS)}))
    parts = []
    hc = mixers[0]
    d = hc.fn.shape[1] // hc.hc

    def mixing_at(r: int) -> dict[str, Callable[[], object]]:
        streams = torch.randn(r, hc.hc, d, generator=torch.Generator().manual_seed(r))
        out = torch.randn(r, d)

        def run(fused: bool) -> object:
            hc.fused = fused
            post, comb, _ = hc(streams)
            return hc.expand(out, streams, post, comb)

        return {"PyTorch": lambda: run(False), "C++": lambda: run(True)}

    geometry = (hc.hc, d, hc.iters, rows)
    fused, line = _judge("hyper-connections", ("mix", *geometry), mixing_at, rows)
    for m in mixers:
        m.fused = fused
    parts.append(line)
    first = attns[0]  # every layer's heads, head_dim and rotary dims are the same

    def rotary_at(r: int) -> dict[str, Callable[[], object]]:
        g = torch.Generator().manual_seed(r)
        q, kv = torch.randn(r, first.heads, first.hd, generator=g), torch.randn(r, first.hd)
        freqs = torch.rand(r, first.rotary_pairs, generator=g) * r
        cos, sin = freqs.cos(), freqs.sin()

        def run(fused: bool) -> object:  # a layer's queries, key and output
            first.fused_rope = fused
            first.norm_rope(q, True, None, cos, sin)
            first.norm_rope(kv, True, first.kv_norm, cos, sin)
            return first.norm_rope(q, False, None, cos, -sin)

        return {"PyTorch": lambda: run(False), "C++": lambda: run(True)}

    geometry = (first.heads, first.hd, first.rotary_pairs, rows)
    fused, line = _judge("RMSNorm + rotary", ("rope", *geometry), rotary_at, rows)
    for a in attns:
        a.fused_rope = fused
    parts.append(line)
    context = max(block_size, min(CONTEXT, max_len))
    for kind, name in ((CSA, "CSA decode"), (HCA, "HCA decode"), (SLIDING, "window decode")):
        layer = next((a for a in attns if a.kind == kind), None)
        if layer is None:
            continue

        def attention_at(r: int, a: V4Attention = layer) -> dict[str, Callable[[], object]]:
            args = decode_inputs(a, r, context, block_size)
            return {"PyTorch": lambda: a.attend(*args), "C++": lambda: a.decode_fused(*args)}

        geometry = (
            kind,
            layer.heads,
            layer.hd,
            getattr(layer, "m", 0),
            getattr(layer, "top_k", 0),
            getattr(layer, "index_heads", 0),
            context,
            block_size,
            rows,
        )
        fused, line = _judge(f"{name} at {context} tokens", geometry, attention_at, rows)
        for a in attns:
            if a.kind == kind:
                a.fused = fused
        parts.append(line)
    return "; ".join(parts)
