"""The startup warm-up: before the server reports healthy, the chosen attention backend runs one
real plan + forward per layer geometry (a prefill chunk with earlier context, then a decode
step), the model runs one decode forward through it, and the sampler runs once (greedy and
seeded rows). A backend whose kernels cannot build or run here (FlashInfer without nvcc, a
JIT failure, a driver too old for the CUDA build) raises here, and the builder passes it over
with the reason in the kernel matrix instead of failing every request later.

Nothing here touches the prefix cache or the global RNG: the KV written goes to blocks no
request owns yet, and the sampled row draws from its own seeded generator.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.runner.step_inputs import step_metadata
from models.llama import LlamaForCausalLM
from models.spec import ModelSpec


class WarmupError(RuntimeError):
    pass


def meta_positions(start: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)


@torch.inference_mode()
def warm_up(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    pool_spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> None:
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.runner.sampler import sample

    # the activations' dtype: a narrower cache (bf16 or int8 under float32) takes the model's
    dtype = model.embed_tokens.weight.dtype
    length = min(block_size + 2, num_blocks * block_size)  # two pages where the pool has them
    table = list(range(-(-length // block_size)))
    split = max(1, length // 2)  # the second chunk has earlier context
    representatives: dict[tuple[int, int, int], int] = {}
    # a model that attends over its KV groups itself (DeepSeek V4) runs whole on each chunk
    whole = bool(pool_spec.group_specs)
    for i, lay in enumerate(() if whole else pool_spec.layers):
        # a layer that writes its KV (and has heads on this tensor-parallel rank)
        if pool_spec.kv_group_owner(lay.kv_group) == i and lay.num_heads:
            representatives.setdefault((lay.num_heads, lay.num_kv_heads, lay.head_dim), i)
    for start, n in ((0, split), (split, length - 1 - split), (length - 1, 1)):
        if n <= 0:
            continue
        _, meta = step_metadata([(table, start, n)], block_size, device)
        step = backend.plan(meta)
        if whole:
            tokens = torch.zeros(n, dtype=torch.long, device=device)
            out = model.compute_logits(model(tokens, meta_positions(start, n, device), step))
            if not bool(torch.isfinite(out).all()):
                raise WarmupError(f"a {n}-token chunk from position {start}: non-finite logits")
        for (heads, kv_heads, head_dim), layer in representatives.items():
            q = torch.full((n, heads, head_dim), 0.01, dtype=dtype, device=device)
            kv = torch.full((n, kv_heads, head_dim), 0.01, dtype=dtype, device=device)
            out = step.forward(layer, q, kv, kv)
            if out.shape != q.shape or not bool(torch.isfinite(out).all()):
                raise WarmupError(
                    f"layer {layer} (heads {heads}/{kv_heads}, head_dim {head_dim}): "
                    f"attention returned shape {tuple(out.shape)} or non-finite values"
                )

    positions, meta = step_metadata([(table, length - 1, 1)], block_size, device)
    hidden = model(torch.zeros(1, dtype=torch.long, device=device), positions, backend.plan(meta))
    logits = model.compute_logits(hidden).expand(2, -1).contiguous()
    if not bool(torch.isfinite(logits).all()):
        raise WarmupError("the model's decode forward produced non-finite logits")
    requests = [
        Request(
            "warmup-greedy", [0], SamplingParams(temperature=0.0), frozenset(), 2, device=device
        ),
        Request(
            "warmup-seeded",
            [0],
            SamplingParams(temperature=1.0, top_p=0.9, seed=0),
            frozenset(),
            2,
            device=device,
        ),
    ]
    ids = sample(logits, requests).token_ids
    if not all(0 <= t < logits.shape[1] for t in ids):
        raise WarmupError(f"the sampler returned token ids {ids}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # surface asynchronous kernel errors here
