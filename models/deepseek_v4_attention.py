"""DeepSeek V4's attention over its KV groups in the paged pool (models/deepseek_v4.py builds the
groups): one shared K=V head with partial interleaved rotary, a learnable sink per head, a grouped
low-rank output projection, and on every layer a sliding window; CSA layers add compressed entries
(two overlapping series, one entry per m tokens) of which a lightning indexer keeps the top k per
query, HCA layers compressed entries (one per m' tokens) attended densely.

State lives only in the pool, addressed by position: the window keys and the compressor's per-token
rows in per-token groups, entry w of a rate-m group in the block holding its window's last token
(slot ((w+1)m-1) % B // m). A window's entry is computed in the step that computes its last token,
from rows the pool holds, and written before any query reads it; so a step that computes positions
from `num_computed_tokens` on needs nothing else, whatever came before (chunked prefill, a prefix
hit, preemption, a verification that rolled positions back: the stale rows and entries past
`num_computed_tokens` are rewritten before they are read again)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import DEEPSEEK_V4
from models.deepseek_v4_plan import Keys, RatePlan, V4Batch, additive
from models.spec import ModelSpec

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (a weight multiplied in float32, as transformers' V4 norms do)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out if weight is None else weight.float() * out).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary on the trailing 2 * cos.shape[-1] channels of x [T, ..., D]; cos and
    sin [T, pairs] broadcast over the middle dims."""
    pairs = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (pairs,)
    c, s = cos.view(shape), sin.view(shape)
    head, tail = x[..., : -2 * pairs], x[..., -2 * pairs :].float()
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)


class Compressor(nn.Module):
    """Pools a window's per-token rows into one entry: softmax over the window of gate + a
    per-position bias, weighted sum of kv, RMSNorm, rotary at the window's first position. CSA
    (`overlap`): two series, the previous window's first half with this window's second."""

    def __init__(self, hidden: int, width: int, m: int, overlap: bool, eps: float) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.m, self.overlap, self.eps = width, m, overlap, eps
        self.kv = nn.Linear(hidden, series * width, bias=False)
        self.gate = nn.Linear(hidden, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(m, series * width))
        self.norm = nn.Parameter(torch.empty(width))

    def rows(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kv(h), self.gate(h)], dim=-1)

    def pool(self, rows: torch.Tensor, plan: RatePlan, batch: V4Batch) -> torch.Tensor:
        """Entries [closing, width] of rows [closing, 2m, row width] (this compressor's part)."""
        d, m = self.width, self.m
        series = 2 if self.overlap else 1
        kv, gate = rows[..., : series * d], rows[..., series * d : 2 * series * d]
        gate = gate.float() + self.position_bias.float()[plan.source_phase]
        if self.overlap:  # first m sources: the previous window's first series; then its own second
            kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
            gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
            gate = gate.masked_fill(~plan.source_valid[:, :, None], float("-inf"))
        else:
            kv, gate = kv[:, m:], gate[:, m:]
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        pooled = rms(pooled, self.norm, self.eps)
        return rope(pooled, *batch.cos_sin("compress", plan.positions.float()[:, None]))


class V4Attention(nn.Module):
    """One layer's attention. Groups (`spec.extra["layer_groups"][idx]`): the window keys; on
    CSA/HCA layers also the compressor's rows and the entries (CSA: the indexer's keys after
    each entry)."""

    def __init__(self, spec: ModelSpec, idx: int) -> None:
        super().__init__()
        x, lay = spec.extra, spec.layers[idx]
        d, hd, heads = spec.hidden_size, lay.head_dim, lay.num_heads
        self.kind = x["layer_types"][idx]
        self.groups = x["layer_groups"][idx]
        self.heads, self.hd, self.eps = heads, hd, spec.rms_norm_eps
        self.window = spec.sliding_window or 0
        self.rotary_pairs = spec.rotary_dim(hd) // 2
        self.label = "main" if self.kind == SLIDING else "compress"
        self.q_a = nn.Linear(d, x["q_lora_rank"], bias=False)
        self.q_a_norm = nn.Parameter(torch.empty(x["q_lora_rank"]))
        self.q_b = nn.Linear(x["q_lora_rank"], heads * hd, bias=False)
        self.kv = nn.Linear(d, hd, bias=False)
        self.kv_norm = nn.Parameter(torch.empty(hd))
        self.o_groups = x["o_groups"]
        self.o_a = nn.Parameter(
            torch.empty(self.o_groups * x["o_lora_rank"], heads * hd // self.o_groups)
        )
        self.o_b = nn.Linear(self.o_groups * x["o_lora_rank"], d, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads))
        # kernels/deepseek_v4.cpp's forms, where the startup measurement found them faster: the
        # decode rows' attention (`fused`), RMSNorm + rotary of the queries, keys and output
        self.fused = self.fused_rope = False
        self.compressor: Compressor | None = None
        self.indexer: Compressor | None = None
        if self.kind != SLIDING:
            self.m = x["compress_rates"][self.kind]
            self.compressor = Compressor(d, hd, self.m, self.kind == CSA, spec.rms_norm_eps)
            self.rows_windowed = spec.group_specs[self.groups[1]].windowed
        if self.kind == CSA:
            ihd, ih = x["index_head_dim"], x["index_n_heads"]
            self.indexer = Compressor(d, ihd, self.m, True, spec.rms_norm_eps)
            self.indexer.q_b = nn.Linear(x["q_lora_rank"], ih * ihd, bias=False)
            self.indexer.weights = nn.Linear(d, ih, bias=False)
            self.index_heads, self.index_dim, self.top_k = ih, ihd, x["index_topk"]

    def forward(self, h: torch.Tensor, batch: V4Batch) -> torch.Tensor:
        t = h.shape[0]
        cos, sin = batch.rope[self.label]
        q_res = rms(self.q_a(h), self.q_a_norm, self.eps)
        q = self.norm_rope(self.q_b(q_res).view(t, self.heads, self.hd), True, None, cos, sin)
        kv = self.norm_rope(self.kv(h), True, self.kv_norm, cos, sin)
        window = batch.caches[self.groups[0]]
        blk, off = batch.token_slots(True)
        window[0, 0, blk, off] = kv.to(window.dtype)
        plan = batch.rate_plans[self.m] if self.compressor is not None else None
        index_q = index_w = None
        if plan is not None:
            self._compress(h, batch, plan)
        if self.indexer is not None:
            iq = self.indexer.q_b(q_res).view(t, self.index_heads, self.index_dim)
            index_q = self.norm_rope(iq, False, None, *batch.rope["compress"]).float()
            index_w = self.indexer.weights(h).float() * self.index_heads**-0.5
        out = q.new_empty(q.shape)
        cache = batch.caches[self.groups[2]] if plan is not None else None
        views, decode = [], batch.decode_rows
        if len(decode):  # the decode rows as one batch, each its own keys
            views.append((decode, batch.decode_window, plan.decode if plan else None))
        for j, (_, rows) in enumerate(batch.prefills):
            views.append((rows, batch.prefill_window[j], plan.prefill[j] if plan else None))
        for j, (rows, win, ent) in enumerate(views):
            # the decode rows (the first view) through the C++ op where it was measured faster
            form = self.decode_fused if j == 0 and self.fused and len(decode) else self.attend
            iq, iw = (index_q[rows], index_w[rows]) if index_q is not None else (None, None)
            out[rows] = form(q[rows], window, win, cache, ent, iq, iw)
        out = self.norm_rope(out, False, None, cos, -sin).reshape(t, self.o_groups, -1)
        weight = self.o_a.view(self.o_groups, -1, out.shape[-1]).transpose(1, 2)
        grouped = torch.bmm(out.transpose(0, 1), weight)  # each head group its own projection
        return self.o_b(grouped.transpose(0, 1).reshape(t, -1))

    def norm_rope(
        self,
        x: torch.Tensor,
        normalise: bool,
        weight: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """rope(rms(x, weight)) (`normalise`) or rope(x), by the C++ op where it serves."""
        if self.fused_rope:
            return DEEPSEEK_V4.load().norm_rope(
                x.contiguous(), normalise, weight, self.eps, cos, sin
            )
        return rope(rms(x, weight, self.eps) if normalise else x, cos, sin)

    def decode_fused(
        self,
        q: torch.Tensor,
        window: torch.Tensor,
        win: Keys,
        cache: torch.Tensor | None,
        ent: Keys | None,
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decode rows' attention by kernels/deepseek_v4.cpp's `sparse_decode`: what the
        PyTorch views compute, reading only the window keys and the entries a row keeps."""
        has = ent is not None and cache is not None
        # the plan's indices broadcast (an entry's slot is the same for every row): the op
        # takes them each [rows, keys]
        win_keys = torch.broadcast_tensors(win.block, win.slot, win.visible)
        ent_keys = torch.broadcast_tensors(ent.block, ent.slot, ent.visible) if has else (None,) * 3
        return DEEPSEEK_V4.load().sparse_decode(
            q.contiguous(),
            window[0, 0],
            *win_keys,
            cache[0, 0] if has else None,
            *ent_keys,
            index_q.contiguous() if index_q is not None else None,
            index_w.contiguous() if index_w is not None else None,
            self.top_k if self.indexer is not None else 0,
            self.sinks,
            self.hd**-0.5,
            self.index_dim**-0.5 if self.indexer is not None else 1.0,
        )

    def attend(
        self,
        q: torch.Tensor,
        window: torch.Tensor,
        win: Keys,
        cache: torch.Tensor | None,
        ent: Keys | None,
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
    ) -> torch.Tensor:
        """Query rows q [n, H, D] over their window keys and (CSA, HCA) compressed entries,
        gathered whole and masked: the PyTorch reference (CSA: the indexer's top k of the
        entries, its queries and weights index_q [n, IH, ID], index_w [n, IH])."""
        keys = window[0, 0, win.block, win.slot].to(q.dtype)  # [1 or rows, L, D]
        bias = additive(win.visible)
        if ent is not None and cache is not None:
            entries = cache[0, 0, ent.block, ent.slot].to(q.dtype)
            seen = ent.visible
            if index_q is not None and index_w is not None:
                seen = self._select(index_q, index_w, entries[..., self.hd :], seen)
            keys = torch.cat([keys, entries[..., : self.hd]], dim=1)
            bias = torch.cat([bias, additive(seen)], dim=-1)
        if keys.shape[0] == 1:
            keys = keys[0]
        return self._attend(q, keys, bias)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax over the keys (K is V) and a sink logit per head: q [n, H, D], keys [L, D]
        (shared by the rows) or [n, L, D], bias [n, L] -> [n, H, D]."""
        shared = keys.dim() == 2
        scores = torch.einsum("nhd,ld->nhl" if shared else "nhd,nld->nhl", q, keys)
        scores = scores.float() * self.hd**-0.5 + bias[:, None, :]
        sink = self.sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.einsum("nhl,ld->nhd" if shared else "nhl,nld->nhd", probs, keys)

    def _select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor
    ) -> torch.Tensor:
        """The lightning indexer: of the entries each query row may see, the top k by
        sum_h w_h relu(q_h . k) / sqrt(d). keys [1 or n, E, d], seen [n, E]."""
        form = "nhd,ld->nhl" if keys.shape[0] == 1 else "nhd,nld->nhl"
        k2 = keys[0] if keys.shape[0] == 1 else keys
        scores = torch.relu(torch.einsum(form, q, k2.float())) * self.index_dim**-0.5
        scores = (scores * w[:, :, None]).sum(dim=1).masked_fill(~seen, float("-inf"))
        k = min(self.top_k, scores.shape[-1])
        if k == 0:
            return seen
        picked = scores.topk(k, dim=-1).indices
        return torch.zeros_like(seen).scatter_(-1, picked, True) & seen

    def _compress(self, h: torch.Tensor, batch: V4Batch, plan: RatePlan) -> None:
        """Write the new tokens' compressor rows, then the entries of the windows they close."""
        assert self.compressor is not None
        rows = self.compressor.rows(h)
        if self.indexer is not None:
            rows = torch.cat([rows, self.indexer.rows(h)], dim=-1)
        cache = batch.caches[self.groups[1]]
        blk, off = batch.token_slots(self.rows_windowed)
        cache[0, 0, blk, off] = rows.to(cache.dtype)
        if not plan.num_closing:
            return
        sb, so = plan.source_slots(self.rows_windowed)
        src = cache[0, 0, sb, so].to(h.dtype)  # [closing, 2m, row width]
        entries = self.compressor.pool(src, plan, batch)
        if self.indexer is not None:
            split = 4 * self.hd
            entries = torch.cat([entries, self.indexer.pool(src[..., split:], plan, batch)], -1)
        eb, es = plan.entry_slot
        target = batch.caches[self.groups[2]]
        target[0, 0, eb, es] = entries.to(target.dtype)
