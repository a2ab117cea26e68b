"""Tensor parallelism's plan: which rank holds which heads, FFN columns and vocabulary rows, and
the slices of each parameter that follow from it. Pure functions of the model's geometry.

Megatron's layout: q/k/v and gate/up are split by output rows (column-parallel), o and down by
input columns (row-parallel), so each rank's partial o/down outputs sum (one all-reduce each) to
the full layer output; the residual stream, norms and embedding stay whole on every rank. The
lm_head is split by vocabulary rows for the step's sampling rows (each rank computes its part
of the logits; one sum joins them); rank 0 also keeps it whole, for everything else that reads
logits (prompt logprobs, scoring, the draft head), which runs there alone.

Heads are planned per *layer group* (consecutive layers of one head geometry), because models
such as OpenELM or Laguna change the head count with depth. A group whose query and KV heads
divide over all N ranks is sharded; one whose KV heads are fewer than the ranks sharing its
query heads replicates each KV head on the ranks of its query group (GQA); in one that fits
neither, each layer goes to the largest subset of ranks that can share it, the subset moving on
from layer to layer (SmolLM2's 9/3 heads over 2 ranks: even layers whole on rank 0, odd ones on
rank 1), the others holding no heads of that layer (they add zeros to the sum). KV bytes per
token then differ by rank and by group: `table` shows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from models.spec import ModelSpec

# FFN columns are split in units of this many where the width allows: GGUF blocks hold 32
# inputs, so a row-parallel down_proj cut on such a boundary keeps its blocks whole.
FFN_ALIGN = 32
# Architectures whose experts are split here: each expert's (and a shared expert's) columns cut
# like a dense FFN's, the router whole on every rank (it reads the whole stream, so every rank
# picks the same experts), one sum for the whole FFN. The cut is the same for Mixtral or
# Qwen3-MoE, but only Laguna's is checked against one rank (tests/test_laguna.py).
EXPERTS_SHARDED = frozenset({"LagunaForCausalLM"})


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One layer's heads on one rank: query heads [q0, q1), KV heads [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The plan of consecutive layers [first, last] that share a head geometry: each layer's
    heads on `size` ranks; all of them, or (a geometry no split of all fits) a subset that
    moves on by `size` ranks from layer to layer, starting at rank `offset`."""

    first: int
    last: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    size: int
    offset: int
    world: int

    @property
    def mode(self) -> str:
        kind = "sharded" if self.num_kv_heads % self.size == 0 else "kv replicated"
        if self.size == self.world:
            return kind
        if self.size == 1:
            return "whole, layer by layer over the ranks"
        return f"{kind} on {self.size} of {self.world} ranks, moving by layer"

    def ranks_of(self, layer: int) -> tuple[int, ...]:
        if self.size == self.world:
            return tuple(range(self.world))
        start = self.offset + (layer - self.first) * self.size
        return tuple((start + j) % self.world for j in range(self.size))


@dataclass(frozen=True, slots=True)
class TPPlan:
    world: int
    groups: tuple[GroupPlan, ...]

    def group_of(self, layer: int) -> GroupPlan:
        return next(g for g in self.groups if g.first <= layer <= g.last)

    def heads(self, layer: int, rank: int) -> HeadShard:
        g = self.group_of(layer)
        ranks = g.ranks_of(layer)
        if rank not in ranks:
            return HeadShard(0, 0, 0, 0)
        i, m = ranks.index(rank), len(ranks)
        per_q = g.num_heads // m
        q0 = i * per_q
        if g.num_kv_heads % m == 0:
            per_kv = g.num_kv_heads // m
            return HeadShard(q0, q0 + per_q, i * per_kv, (i + 1) * per_kv)
        k0 = q0 // (g.num_heads // g.num_kv_heads)  # this rank's heads share one KV head
        return HeadShard(q0, q0 + per_q, k0, k0 + 1)

    def layer_kv_bytes(self, layer: int, rank: int, head_dim: int, dtype_size: float) -> int:
        """Bytes of K and V one token takes in `layer` on `rank`."""
        h = self.heads(layer, rank)
        return round(2 * (h.k1 - h.k0) * head_dim * dtype_size)

    def table(self, spec: ModelSpec, dtype_size: float) -> str:
        """The plan per layer group with each rank's KV bytes per token, for the kernel
        matrix."""
        per_rank = [0] * self.world
        lines = [f"  tensor parallel: {self.world} ranks, per layer group:"]
        for g in self.groups:
            kv, held = [0] * self.world, [0] * self.world
            for layer in range(g.first, g.last + 1):
                for r in range(self.world):
                    h = self.heads(layer, r)
                    kv[r] += round(2 * (h.k1 - h.k0) * g.head_dim * dtype_size)
                    held[r] += h.q1 > h.q0
            per_rank = [a + b for a, b in zip(per_rank, kv, strict=True)]
            shard = [self.heads(g.first, r) for r in g.ranks_of(g.first)][0]
            each = f"{shard.q1 - shard.q0}/{shard.k1 - shard.k0} q/kv heads"
            layers = " ".join(f"r{r}:{n}" for r, n in enumerate(held))
            # one layer's bytes by rank: the same for every layer of a group split over all
            # ranks; by turns ("384/0 or 0/384") where its layers move from rank to rank
            a_layer = " or ".join(
                dict.fromkeys(
                    "/".join(
                        str(self.layer_kv_bytes(layer, r, g.head_dim, dtype_size))
                        for r in range(self.world)
                    )
                    for layer in range(g.first, g.last + 1)
                )
            )
            lines.append(
                f"    layers {g.first}-{g.last}: {g.num_heads}/{g.num_kv_heads} heads, {g.mode} "
                f"({each} a rank; layers by rank {layers}); KV bytes/token by rank "
                f"{'/'.join(map(str, kv))} (a layer: {a_layer})"
            )
        lines.append(f"    KV bytes/token by rank, all layers: {'/'.join(map(str, per_rank))}")
        return "\n".join(lines)


def plan_tensor_parallel(spec: ModelSpec, world: int) -> TPPlan:
    """The plan for `world` ranks; ValueError, with the reason, for a layout it cannot split."""
    if world < 1:
        raise ValueError("tensor_parallel_size must be >= 1")
    if spec.architecture == "Gemma4ForCausalLM":
        raise ValueError(
            "tensor parallelism is not planned for Gemma 4 (its per-layer inputs, experts beside "
            "the dense MLP and k=v layers have no shard plan yet); serve with "
            "--tensor-parallel-size 1"
        )
    if spec.has_kv_sharing:
        raise ValueError(
            "tensor parallelism does not split models whose layers share KV across layers "
            "(the sharing layers' head shards would have to agree); serve with "
            "--tensor-parallel-size 1"
        )
    if spec.is_moe and spec.architecture not in EXPERTS_SHARDED:
        raise ValueError(
            "tensor parallelism splits mixture-of-experts layers only where that is tested "
            f"({', '.join(sorted(EXPERTS_SHARDED))}); serve with --tensor-parallel-size 1"
        )
    groups: list[GroupPlan] = []
    for i, lay in enumerate(spec.layers):
        geometry = (lay.num_heads, lay.num_kv_heads, lay.head_dim)
        prev = groups[-1] if groups else None
        if prev and (prev.num_heads, prev.num_kv_heads, prev.head_dim) == geometry:
            groups[-1] = replace(prev, last=i)
            continue
        m = max(k for k in range(1, world + 1) if _splits(lay.num_heads, lay.num_kv_heads, k))
        groups.append(GroupPlan(i, i, *geometry, size=m, offset=0, world=world))
    # subsets move on from layer to layer and from group to group, so that the layers that
    # cannot be split over every rank still spread their attention and KV over all of them
    rotate = 0
    for k, g in enumerate(groups):
        if g.size < world:
            groups[k] = replace(g, offset=rotate)
            rotate = (rotate + (g.last - g.first + 1) * g.size) % world
    return TPPlan(world, tuple(groups))


def _splits(num_heads: int, num_kv_heads: int, m: int) -> bool:
    """Whether m ranks can share a layer's heads: equal query heads each, and each rank's
    query heads within whole KV heads of its own (sharded) or one shared KV head (replicated)."""
    if num_heads % m:
        return False
    if num_kv_heads % m == 0:
        return True
    group = num_heads // num_kv_heads  # query heads per KV head
    return m % num_kv_heads == 0 and group % (num_heads // m) == 0


def split(total: int, world: int, rank: int, align: int = 1) -> tuple[int, int]:
    """[start, end) of rank's near-equal part of `total`, cut on multiples of `align` where
    `total` allows."""
    unit = align if total % align == 0 and total // align >= world else 1
    units = total // unit
    start = rank * units // world
    return start * unit, (rank + 1) * units // world * unit


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one rank holds: its geometry (a ModelSpec of local head counts and FFN widths) and
    the slices of each full parameter (in the model's own names) that fill it."""

    full: ModelSpec
    plan: TPPlan
    rank: int

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def spec(self) -> ModelSpec:
        layers = []
        for i, lay in enumerate(self.full.layers):
            h = self.plan.heads(i, self.rank)
            f0, f1 = split(lay.intermediate_size, self.world, self.rank, FFN_ALIGN)
            layers.append(
                replace(
                    lay, num_heads=h.q1 - h.q0, num_kv_heads=h.k1 - h.k0, intermediate_size=f1 - f0
                )
            )
        extra = dict(self.full.extra)
        shared = extra.get("shared_expert_intermediate_size")
        if shared:  # a shared expert's columns are cut like the experts'
            s0, s1 = split(shared, self.world, self.rank, FFN_ALIGN)
            extra["shared_expert_intermediate_size"] = s1 - s0
        return replace(self.full, layers=tuple(layers), extra=extra)

    def _ffn_width(self, parts: list[str]) -> int:
        """The width of the FFN a gate_up/down parameter belongs to: a layer's dense FFN or an
        expert ("layers.3.moe.experts.5.down_proj.weight"), or the shared expert
        ("layers.3.moe.shared.down_proj.weight")."""
        if parts[2:4] == ["moe", "shared"]:
            return int(self.full.extra["shared_expert_intermediate_size"])
        return self.full.layers[int(parts[1])].intermediate_size

    @property
    def vocab_part(self) -> tuple[int, int]:
        """The vocabulary rows [v0, v1) whose logits this rank computes in a step."""
        return self.vocab_part_of(self.full.vocab_size, self.world, self.rank)

    @staticmethod
    def vocab_part_of(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
        return split(vocab_size, world, rank)

    @property
    def vocab_rows(self) -> tuple[int, int] | None:
        """The lm_head rows this rank's model holds: rank 0 all of them (None), the others
        their vocabulary part."""
        return None if self.rank == 0 else self.vocab_part

    def row_ranges(self, name: str) -> list[tuple[int, int]] | None:
        """Output rows of `name` this rank holds (column-parallel), or None if not cut so."""
        if name == "lm_head.weight" and self.vocab_rows is not None:
            return [self.vocab_rows]
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 4:
            return None
        i, module = int(parts[1]), parts[-2]
        lay = self.full.layers[i]
        h, d = self.plan.heads(i, self.rank), lay.head_dim
        if module == "qkv_proj":
            q, kv = lay.num_heads * d, lay.num_kv_heads * d
            return [
                (h.q0 * d, h.q1 * d),
                (q + h.k0 * d, q + h.k1 * d),
                (q + kv + h.k0 * d, q + kv + h.k1 * d),
            ]
        if module == "g_proj":  # an output gate (Laguna): one row per head, or per element
            unit = 1 if self.full.extra.get("output_gate") == "head" else d
            return [(h.q0 * unit, h.q1 * unit)]
        if module == "gate_up_proj":
            inter = self._ffn_width(parts)
            f0, f1 = split(inter, self.world, self.rank, FFN_ALIGN)
            return [(f0, f1), (inter + f0, inter + f1)]
        return None

    def col_range(self, name: str) -> tuple[int, int] | None:
        """Input columns of `name` this rank holds (row-parallel), or None if not cut so."""
        parts = name.split(".")
        if parts[0] != "layers" or parts[-1] != "weight" or len(parts) < 4:
            return None
        i, module = int(parts[1]), parts[-2]
        lay = self.full.layers[i]
        if module == "o_proj":
            h = self.plan.heads(i, self.rank)
            return h.q0 * lay.head_dim, h.q1 * lay.head_dim
        if module == "down_proj":
            return split(self._ffn_width(parts), self.world, self.rank, FFN_ALIGN)
        return None

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full parameter (weights and biases alike)."""
        rows = self.row_ranges(name)
        if rows is not None:
            return torch.cat([tensor[a:b] for a, b in rows])
        cols = self.col_range(name)
        if cols is not None:
            return tensor[:, cols[0] : cols[1]].contiguous()
        return tensor

    def cut_blocks(self, name: str, blocks: torch.Tensor, block_bytes: int) -> torch.Tensor | None:
        """This rank's part of a weight held as ggml blocks (uint8 [rows, bytes], 32 inputs a
        block), or None where a column cut would split a block (it is then served dense)."""
        rows = self.row_ranges(name)
        if rows is not None:
            return torch.cat([blocks[a:b] for a, b in rows])
        cols = self.col_range(name)
        if cols is None:
            return blocks
        if cols[0] % 32 or cols[1] % 32:
            return None
        return blocks[:, cols[0] // 32 * block_bytes : cols[1] // 32 * block_bytes].contiguous()

    def weights(
        self, full: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Cut each (name, tensor) of full parameters."""
        for name, tensor in full:
            part = self.cut(name, tensor)
            if part.numel():  # a layer none of whose heads are here has no q/k/v/o
                yield name, part
