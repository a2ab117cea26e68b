"""bfloat16 and float16 through the torch attention backend on CPU, against float32 on a tiny
model: the GPU fallback path (no FlashInfer, head dims it lacks, sm < 80,
`--attention-backend torch`) runs these same PyTorch ops, so a dtype error here is one there.

Both decode strategies (range views over the pool, page gathers) and prefill with earlier
context are driven directly through the model and the backend, teacher-forced with float32's
greedy tokens so that every step compares the same inputs.

Tolerances: the max abs logit difference against float32, relative to float32's largest logit,
stays under 5% in bfloat16 (8-bit mantissa) and 1% in float16 (11-bit); the greedy token agrees
with float32's on at least 90% of decode rows (a random tiny model has near-ties).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.torch_backend import TorchBackend
from engine.runner.model_runner import allocate_kv_caches
from engine.runner.step_inputs import step_metadata
from models.loader import load_model

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01}
PROMPTS = [[5, 17, 99, 3, 250, 44, 8], list(range(10, 50)), [7] * 20, [300, 301, 302], [9, 8]]
BLOCK = 4
STEPS = 6


def run_steps(path: str, dtype: torch.dtype, strategy: str, forced: list[list[int]] | None):
    """Prefill PROMPTS (two chunks: the second has earlier context), then STEPS decode steps of
    all sequences at once. Returns the float32 logits of every decode row [steps, seqs, vocab]
    and the greedy tokens; `forced` feeds given tokens instead (teacher forcing)."""
    model, spec = load_model(path, dtype, "cpu")
    num_blocks = 64
    caches = allocate_kv_caches(TorchBackend, spec.kv_groups, num_blocks, BLOCK, dtype, "cpu")
    backend = TorchBackend(spec, caches, BLOCK)
    if strategy == "cpp":  # the C++ decode op reads float32 and bfloat16 caches
        assert backend.decode_op is not None
    else:
        backend.decode_op = None  # the PyTorch ops
    backend.use_range_decode = strategy == "range"
    per_seq = num_blocks // len(PROMPTS)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    dev = torch.device("cpu")

    def forward(seqs: list[tuple[int, int, int]], ids: list[int]) -> torch.Tensor:
        positions, meta = step_metadata([(tables[i], s, n) for i, s, n in seqs], BLOCK, dev)
        step = backend.plan(meta)
        hidden = model(torch.tensor(ids), positions, step)
        ends = torch.tensor(meta.query_start) + torch.tensor(meta.query_lens) - 1
        return model.compute_logits(hidden.index_select(0, ends))

    half = [len(p) // 2 for p in PROMPTS]
    first = [t for p, h in zip(tokens, half) for t in p[:h]]
    forward([(i, 0, h) for i, h in enumerate(half)], first)
    logits = forward(
        [(i, h, len(p) - h) for i, (p, h) in enumerate(zip(tokens, half))],
        [t for p, h in zip(tokens, half) for t in p[h:]],
    )
    rows, greedy = [], []
    for step in range(STEPS):
        chosen = logits.argmax(-1).tolist()
        greedy.append(chosen)
        nxt = forced[step] if forced is not None else chosen
        for seq, t in zip(tokens, nxt):
            seq.append(t)
        logits = forward([(i, len(s) - 1, 1) for i, s in enumerate(tokens)], nxt)
        rows.append(logits)
    return torch.stack(rows), greedy


@pytest.mark.parametrize(
    "dtype, strategy",
    [
        (torch.bfloat16, "cpp"),
        (torch.bfloat16, "range"),
        (torch.bfloat16, "gather"),
        (torch.float16, "range"),
        (torch.float16, "gather"),
    ],
    ids=["bf16-cpp", "bf16-range", "bf16-gather", "fp16-range", "fp16-gather"],
)
def test_low_precision_decode_matches_float32(llama_dir, dtype, strategy) -> None:
    ref, greedy = run_steps(str(llama_dir), torch.float32, strategy, None)
    got, got_greedy = run_steps(str(llama_dir), dtype, strategy, greedy)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < TOLERANCE[dtype], f"{dtype} {strategy}: max logit error {rel:.4f} of max"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"{dtype} {strategy}: greedy agreement {agree:.2f}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_serves_low_precision_on_cpu(llama_dir, dtype) -> None:
    """The whole engine (prefill, batched decode, sampling) in bf16/fp16: every request
    finishes by length, none by error."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, dtype=dtype, allow_slow_dtype=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True),
    ]
    out = llm.generate(PROMPTS * 2, params * len(PROMPTS))
    assert [o.outputs[0].finish_reason for o in out] == ["length"] * len(out)
