"""Where one step's tokens, windows and compressed entries sit in DeepSeek V4's KV groups: built
once per forward from the backend's `PagedBatch` and read by every layer
(models/deepseek_v4_attention.py). All index math is tensor ops over padded block tables, none a
Python loop over tokens or entries.

Entry w of a rate-m group lives in the block holding its window's last token, (w+1)m - 1, at slot
((w+1)m - 1) % B // m: so a full block's entries depend only on the tokens up to its end (a
prefix hit brings them), whether m divides B or B divides m."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention_step import PagedBatch
from models.layers import rope_attention_factor, rope_inv_freq
from models.spec import ModelSpec

NEG_INF = float("-inf")


def padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[seqs, longest] block ids, padded with block 0 (read only under a mask)."""
    width = max((len(t) for t in tables), default=0) or 1
    out = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return out.to(device)


def additive(visible: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere (float32)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, NEG_INF)


@dataclass(slots=True)
class Keys:
    """Keys (or entries) gathered for a set of query rows: (block, slot) indices and, per row,
    which are visible ([rows, keys] bool)."""

    block: torch.Tensor
    slot: torch.Tensor
    visible: torch.Tensor


class V4Batch:
    def __init__(self, spec: ModelSpec, paged: PagedBatch, positions: torch.Tensor) -> None:
        self.paged, self.caches, self.bs = paged, paged.kv_caches, paged.block_size
        device = positions.device
        self.window = spec.sliding_window or 0
        pos = positions.float()[:, None]
        rotary = spec.rotary_dim(spec.layers[0].head_dim)
        # each rope's frequencies and its cos/sin magnitude (YaRN's attention factor)
        self.inv_freq = {
            label: (
                rope_inv_freq(rotary, theta, scaling).to(device),
                rope_attention_factor(scaling),
            )
            for label, (theta, scaling) in spec.extra["ropes"].items()
        }
        self.rope = {label: self.cos_sin(label, pos) for label in self.inv_freq}
        windowed = paged.window_block_tables or paged.block_tables
        self.tables = {False: padded(paged.block_tables, device), True: padded(windowed, device)}
        q_lens = torch.tensor(paged.query_lens, device=device)
        self.ctx = torch.tensor(paged.context_lens, device=device)
        self.end = self.ctx + q_lens
        self.token_seq = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens)
        self.token_pos = positions.long()
        # one query row per sequence: attended as a batch; longer chunks one sequence at a time
        decode = [i for i, q in enumerate(paged.query_lens) if q == 1]
        self.decode_rows = torch.tensor(
            [paged.query_start[i] for i in decode], device=device, dtype=torch.long
        )
        self.decode_seqs = torch.tensor(decode, device=device, dtype=torch.long)
        spans = zip(paged.query_start, paged.query_lens)
        self.prefills = [(i, slice(s, s + q)) for i, (s, q) in enumerate(spans) if q > 1]
        self._slots: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decode_window = self._window_keys(
            self.token_pos[self.decode_rows][:, None], self.decode_seqs
        )
        self.prefill_window = [
            self._window_keys(
                self.token_pos[rows][:, None],
                torch.tensor(i),
                self.ctx[i] - self.window + 1,
                self.end[i],
            )
            for i, rows in self.prefills
        ]
        self.rate_plans = {m: RatePlan(self, m) for m in set(spec.extra["compress_rates"].values())}

    def cos_sin(self, label: str, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope `label`'s cos and sin [rows, pairs] at float positions `pos` [rows, 1]."""
        inv, scale = self.inv_freq[label]
        freqs = pos * inv
        if scale == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * scale, freqs.sin() * scale

    def locate(
        self, windowed: bool, seq: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions `pos` of sequences `seq` (broadcast) in a per-token
        group; positions past a table read its last column (they are masked)."""
        table = self.tables[windowed]
        col = (pos // self.bs).clamp(0, table.shape[1] - 1)
        return table[seq, col], pos % self.bs

    def token_slots(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of every new token in a per-token group."""
        if windowed not in self._slots:
            self._slots[windowed] = self.locate(windowed, self.token_seq, self.token_pos)
        return self._slots[windowed]

    def _window_keys(
        self,
        t: torch.Tensor,
        seq: torch.Tensor,
        first: torch.Tensor | None = None,
        end: torch.Tensor | None = None,
    ) -> Keys:
        """The window's keys for queries at positions t [rows, 1]: the same span for all rows
        (a chunk: first..end) or each row its own (decode: t - W + 1..t)."""
        if first is None:
            keys = t - self.window + 1 + torch.arange(self.window, device=t.device)[None, :]
        else:
            keys = torch.arange(int(max(0, int(first))), int(end), device=t.device)[None, :]
        visible = (keys >= 0) & (keys <= t) & (t - keys < self.window)
        blk, off = self.locate(True, seq if first is not None else seq[:, None], keys.clamp(0))
        return Keys(blk, off, visible)


class RatePlan:
    """For one compression rate m: the windows that close in this step (their sources' rows and
    where their entries go) and the entries each query row may read."""

    def __init__(self, batch: V4Batch, m: int) -> None:
        self.m, self.batch = m, batch
        first, last = batch.ctx // m, batch.end // m  # windows closing: [first, last)
        counts = last - first
        device = counts.device
        self.seq = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        starts = torch.cumsum(counts, 0) - counts
        w = first[self.seq] + torch.arange(int(counts.sum()), device=device) - starts[self.seq]
        self.num_closing = int(w.numel())
        self.positions = w * m  # where an entry's rotary sits
        self.entry_slot = self.locate(self.seq, w)
        # a closing window's sources: the previous window (CSA's first series) and its own
        offsets = torch.arange(-m, m, device=device)
        self.source_pos = w[:, None] * m + offsets[None, :]  # [closing, 2m]
        self.source_valid = self.source_pos >= 0
        self.source_phase = offsets % m
        self._sources: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        d = batch.decode_seqs
        n = batch.end[d] // m
        ws = torch.arange(int(n.max()) if len(n) else 0, device=device)[None, :]
        self.decode = Keys(*self.locate(d[:, None], ws), ws < n[:, None])
        self.prefill = []
        for i, rows in batch.prefills:
            ws = torch.arange(int(batch.end[i]) // m, device=device)[None, :]
            t = batch.token_pos[rows][:, None]
            self.prefill.append(Keys(*self.locate(torch.tensor(i), ws), ws < (t + 1) // m))

    def locate(self, seq: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of entries w of sequences `seq` (broadcast)."""
        last = (w + 1) * self.m - 1
        blk, _ = self.batch.locate(False, seq, last)
        return blk, (last % self.batch.bs) // self.m

    def source_slots(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [closing, 2m] of the closing windows' source rows (positions before
        the sequence's start are masked)."""
        if windowed not in self._sources:
            self._sources[windowed] = self.batch.locate(
                windowed, self.seq[:, None], self.source_pos.clamp(min=0)
            )
        return self._sources[windowed]
