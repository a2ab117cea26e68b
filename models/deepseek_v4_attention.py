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

from models.attention_step import PagedBatch
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


def inv_freq(rotary: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))


class V4Batch:
    """Where the step's tokens, windows and entries sit in the pool, shared by every layer:
    built once per forward from the backend's `PagedBatch`."""

    def __init__(self, spec: ModelSpec, paged: PagedBatch, positions: torch.Tensor) -> None:
        self.paged, self.spec = paged, spec
        self.caches, bs = paged.kv_caches, paged.block_size
        device = positions.device
        self.window = spec.sliding_window or 0
        rotary = spec.rotary_dim(spec.layers[0].head_dim)
        pos = positions.float()[:, None]
        self.rope = {
            label: ((pos * inv).cos(), (pos * inv).sin())
            for label, inv in (("main", inv_freq(rotary, spec.rope_theta)),
                               ("compress", inv_freq(rotary, spec.extra["compress_rope_theta"])))
        }  # fmt: skip
        self.compress_inv = inv_freq(rotary, spec.extra["compress_rope_theta"]).to(device)
        tables = {False: paged.block_tables, True: paged.window_block_tables or paged.block_tables}
        self.tables = {k: [torch.tensor(t, dtype=torch.long) for t in v] for k, v in tables.items()}
        self.seqs = []  # (rows, first position, sequence length)
        for start, q_len, ctx in zip(paged.query_start, paged.query_lens, paged.context_lens):
            self.seqs.append((slice(start, start + q_len), ctx, ctx + q_len))
        self.token_pos = [torch.arange(ctx, end) for _, ctx, end in self.seqs]
        self.rate_plans: dict[int, RatePlan] = {}
        for rate in set(spec.extra["compress_rates"].values()):
            self.rate_plans[rate] = RatePlan(self, rate, bs, device)
        self._slots: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self.window_keys: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i, (_, ctx, end) in enumerate(self.seqs):
            first = max(0, ctx - self.window + 1)
            keys = torch.arange(first, end)
            blk, off = self.locate(True, i, keys)
            t = self.token_pos[i][:, None]
            visible = (keys[None, :] <= t) & (t - keys[None, :] < self.window)
            self.window_keys.append((blk.to(device), off.to(device), visible.to(device)))

    def locate(self, windowed: bool, seq: int, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bs = self.paged.block_size
        return self.tables[windowed][seq][positions // bs], positions % bs

    def token_slots(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of every new token in a per-token group."""
        if windowed not in self._slots:
            parts = [self.locate(windowed, i, p) for i, p in enumerate(self.token_pos)]
            blk = torch.cat([b for b, _ in parts]) if parts else torch.zeros(0, dtype=torch.long)
            off = torch.cat([o for _, o in parts]) if parts else torch.zeros(0, dtype=torch.long)
            device = self.caches[0].device
            self._slots[windowed] = (blk.to(device), off.to(device))
        return self._slots[windowed]


class RatePlan:
    """For one compression rate m: the windows that close in this step (their sources' rows and
    where their entries go) and, per sequence, where its entries are and which queries see them."""

    def __init__(self, batch: V4Batch, m: int, bs: int, device: torch.device) -> None:
        self.m, self.batch = m, batch
        closing = [(i, w) for i, (_, ctx, end) in enumerate(batch.seqs)
                   for w in range(ctx // m, end // m)]  # fmt: skip
        self.num_closing = len(closing)
        self.closing_seqs = [i for i, _ in closing]
        w = torch.tensor([w for _, w in closing], dtype=torch.long)
        self.positions = (w * m).to(device)  # where an entry's rotary sits
        self.entry_slot = self.locate(self.closing_seqs, w, device)
        # a closing window's sources: the previous window (CSA's first series) and its own
        offsets = torch.arange(-m, m)
        self.source_pos = w[:, None] * m + offsets[None, :]  # [closing, 2m]
        self.source_valid = (self.source_pos >= 0).to(device)
        self.source_phase = (offsets % m).to(device)
        self._sources: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries = []  # per sequence: block, slot of entries 0..n-1; visibility [q, n]
        for i, (_, _, end) in enumerate(batch.seqs):
            ws = torch.arange(end // m)
            t = batch.token_pos[i][:, None]
            visible = (ws[None, :] < (t + 1) // m).to(device)
            self.entries.append((*self.locate([i] * len(ws), ws, device), visible))

    def locate(self, seqs: list[int], w: torch.Tensor, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(block, slot) of entries w of sequences `seqs`: in the block of the window's last
        token, slot ((w+1)m-1) % B // m."""
        bs = self.batch.paged.block_size
        last = (w + 1) * self.m - 1
        tables = self.batch.tables[False]
        blk = torch.stack([tables[i][p // bs] for i, p in zip(seqs, last)]) if seqs else last
        return blk.to(device), ((last % bs) // self.m).to(device)

    def source_slots(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [closing, 2m] of the closing windows' source rows (positions before
        the sequence's start point at its first block; they are masked)."""
        if windowed not in self._sources:
            bs, src = self.batch.paged.block_size, self.source_pos.clamp(min=0)
            tables = self.batch.tables[windowed]
            blk = (torch.stack([tables[i][p // bs] for i, p in zip(self.closing_seqs, src)])
                   if self.num_closing else src)  # fmt: skip
            device = self.batch.caches[0].device
            self._sources[windowed] = (blk.to(device), (src % bs).to(device))
        return self._sources[windowed]


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
        freqs = plan.positions.float()[:, None] * batch.compress_inv
        return rope(pooled, freqs.cos(), freqs.sin())


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
        self.label = "main" if self.kind == SLIDING else "compress"
        self.q_a = nn.Linear(d, x["q_lora_rank"], bias=False)
        self.q_a_norm = nn.Parameter(torch.empty(x["q_lora_rank"]))
        self.q_b = nn.Linear(x["q_lora_rank"], heads * hd, bias=False)
        self.kv = nn.Linear(d, hd, bias=False)
        self.kv_norm = nn.Parameter(torch.empty(hd))
        self.o_groups = x["o_groups"]
        self.o_a = nn.Parameter(torch.empty(self.o_groups * x["o_lora_rank"],
                                            heads * hd // self.o_groups))  # fmt: skip
        self.o_b = nn.Linear(self.o_groups * x["o_lora_rank"], d, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads))
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
        q = rope(rms(self.q_b(q_res).view(t, self.heads, self.hd), None, self.eps), cos, sin)
        kv = rope(rms(self.kv(h), self.kv_norm, self.eps), cos, sin)
        window = batch.caches[self.groups[0]]
        blk, off = batch.token_slots(True)
        window[0, 0, blk, off] = kv.to(window.dtype)
        plan = batch.rate_plans[self.m] if self.compressor is not None else None
        index_q = index_w = None
        if plan is not None:
            self._compress(h, batch, plan)
        if self.indexer is not None:
            iq = self.indexer.q_b(q_res).view(t, self.index_heads, self.index_dim)
            index_q = rope(iq, *batch.rope["compress"]).float()
            index_w = self.indexer.weights(h).float() * self.index_heads**-0.5
        out = q.new_empty(q.shape)
        for i, (rows, _, _) in enumerate(batch.seqs):
            kb, ko, visible = batch.window_keys[i]
            keys = window[0, 0, kb, ko].to(q.dtype)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
            bias.masked_fill_(~visible, float("-inf"))
            if plan is not None:
                eb, es, seen = plan.entries[i]
                entries = batch.caches[self.groups[2]][0, 0, eb, es].to(q.dtype)
                if index_q is not None:
                    seen = self._select(index_q[rows], index_w[rows], entries[:, self.hd :], seen)
                ebias = torch.zeros(seen.shape, dtype=torch.float32, device=q.device)
                ebias.masked_fill_(~seen, float("-inf"))
                keys = torch.cat([keys, entries[:, : self.hd]])
                bias = torch.cat([bias, ebias], dim=-1)
            out[rows] = self._attend(q[rows], keys, bias)
        out = rope(out, cos, -sin).reshape(t, self.o_groups, -1)
        weight = self.o_a.view(self.o_groups, -1, out.shape[-1]).transpose(1, 2)
        grouped = torch.bmm(out.transpose(0, 1), weight)  # each head group its own projection
        return self.o_b(grouped.transpose(0, 1).reshape(t, -1))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax over the keys (K is V) and a sink logit per head: q [n, H, D], keys [L, D],
        bias [n, L] -> [n, H, D]."""
        scores = torch.einsum("nhd,ld->hnl", q, keys).float() * self.hd**-0.5 + bias
        sink = self.sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hnl,ld->nhd", probs.to(keys.dtype), keys)

    def _select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
        """The lightning indexer: of the entries each query may see, the top k by
        sum_h w_h relu(q_h . k) / sqrt(d)."""
        scores = torch.relu(torch.einsum("nhd,ld->nhl", q, keys.float())) * self.index_dim**-0.5
        scores = (scores * w[:, :, None]).sum(dim=1).masked_fill(~seen, float("-inf"))
        k = min(self.top_k, scores.shape[-1])
        if k == 0:
            return seen
        picked = scores.topk(k, dim=-1).indices
        chosen = torch.zeros_like(seen).scatter_(-1, picked, True)
        return chosen & seen

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
