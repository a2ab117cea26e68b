"""A decode step's whole decoder stack in one op (models/decode_stack.py): taken for decode steps
of the shipped GGUF (float and int8 activations, float32 and bf16), and the same tokens and the
same logprobs as the per-layer path, bit for bit (it calls the same kernels in the same order);
not taken where it does not apply (prefill, a float checkpoint)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from models.linear import decode_stack, gguf_linear
from models.llama import LlamaForCausalLM

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

needs_ops = pytest.mark.skipif(
    decode_stack.load() is None, reason="kvserve's C++ ops cannot be built here"
)
PROMPTS = ["The capital of France is", "def fib(n):\n    if n < 2:"]


def generate(llm: LLM, monkeypatch, stacked: bool, prompts=PROMPTS) -> tuple[list, int]:
    """(token ids and logprobs per prompt, decode steps the stack op served)."""
    calls = []
    real = LlamaForCausalLM._decode_stack

    def counted(self, *args):
        out = real(self, *args) if stacked else None
        calls.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(LlamaForCausalLM, "_decode_stack", counted)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return got, sum(calls)


@needs_ops
@pytest.mark.parametrize(
    ("dtype", "activations"), [("float32", "off"), ("bfloat16", "off"), ("float32", "on")]
)
def test_stack_op_is_the_per_layer_path(smollm2_path, monkeypatch, dtype, activations) -> None:
    if activations == "on" and gguf_linear.load_q8() is None:
        pytest.skip("the int8-activation kernel needs AVX2")
    # (bf16 where it is slow too, as under the AVX2 restriction: the paths are compared, not timed)
    llm = LLM(
        smollm2_path,
        num_kv_blocks=16,
        dtype=dtype,
        gguf_int8_activations=activations,
        num_speculative_tokens=0,
        enable_prefix_caching=False,
        allow_slow_dtype=True,
    )
    # the batch's rows on the block kernel whatever the startup timing chose (a busy machine
    # may time the dense path faster at two rows; the stack op serves the kernel's rows only)
    for weights in gguf_linear.weight_groups(llm.engine.model).values():
        for w in weights:
            w.kernel_max_rows = max(w.kernel_max_rows, len(PROMPTS))
    stacked, served = generate(llm, monkeypatch, True)
    layered, none = generate(llm, monkeypatch, False)
    assert served >= 11 and none == 0  # every decode step of the batch took the op
    assert stacked == layered
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


@needs_ops
def test_stack_op_is_not_taken_for_a_float_checkpoint(llama_dir, monkeypatch) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", num_speculative_tokens=0)
    _, served = generate(llm, monkeypatch, True, [[5, 17, 99, 3], list(range(10, 30))])
    assert served == 0
