"""The architectures people run beyond the Llama family (issue #46): Gemma 3 (sliding-window
layers interleaved with global ones, sandwich norms, GeGLU, its own softmax scale), Phi-3/4
(fused projections, partial rotary, LongRoPE) and mixtures of experts (Qwen3-MoE, Mixtral), each
a tiny random checkpoint through the engine against `transformers` on the same weights: from
the HF directory and from a GGUF written from it as llama.cpp's converter does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from tests.conftest import TINY_TEXT, F, S, build_dirs, build_random, build_tokenizer
from tests.gguf_export import write_gguf

pytestmark = pytest.mark.isa  # the C++ attention and block kernels again as an AVX2 CPU runs them

BASE = TINY_TEXT | dict(tie_word_embeddings=False)
ROPE_FACTORS = dict(
    short_factor=[1.0 + 0.1 * i for i in range(6)], long_factor=[2.0 + 0.3 * i for i in range(6)]
)
NEW_ARCHS = {
    # six layers: llama.cpp's fixed Gemma 3 pattern (five windowed, then a global one); a
    # window of 8 far inside every prompt below
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
        ),
    ),
    # a softmax scale that is not head_dim's (Gemma 3 27B's); GGUF has no field for it
    # (llama.cpp knows the 27B by its layer count), so HF only
    "gemma3-scaled": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=[S, F],
        ),
    ),
    # Phi-4-mini's shape of rotary (three quarters of each head) under LongRoPE
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            original_max_position_embeddings=128,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                **ROPE_FACTORS,
            },
        ),
    ),
    # six experts, two a token, renormalised (Qwen3-30B-A3B's routing)
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
}
PROMPTS = [[5, 17, 99, 3, 250, 44, 8], list(range(10, 60)), [7, 8, 9] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def build(arch: str, out: Path) -> Path:
    cfg_name, model_name, overrides = NEW_ARCHS[arch]
    # Gemma multiplies by (1 + w): norms around 1 either way
    norm_center = 0.0 if arch == "gemma3" else 1.0
    return build_random(cfg_name, model_name, BASE | overrides, arch, out, norm_center)


@pytest.fixture(scope="module")
def new_dirs(tmp_path_factory) -> dict[str, Path]:
    return build_dirs(tmp_path_factory, "new-archs", build, NEW_ARCHS)


def reference(path: Path, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def reference_greedy(ref, prompts=PROMPTS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (16 tokens, as GREEDY)."""
    with torch.no_grad():
        return [
            ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def assert_matches(llm: LLM, ref, prompts=PROMPTS, greedy: list[list[int]] | None = None) -> None:
    """Every prompt's logits within 1e-4 of transformers', greedy decoding its tokens (`greedy`:
    `reference_greedy`, computed once by a caller that checks several engines), and every KV
    block free after."""
    for prompt in prompts:
        ours = score_prompt(llm.engine, prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    want = reference_greedy(ref, prompts) if greedy is None else greedy
    assert [res.outputs[0].token_ids for res in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def whole_and_chunked(path: Path, **engine) -> Iterator[LLM]:
    """An engine on `path` that prefills each prompt whole, then one that prefills in chunks of
    7 (windows across chunk boundaries); `engine`: more options for both."""
    for chunk in (1024, 7):
        yield LLM(str(path), num_kv_blocks=96, block_size=4, max_num_batched_tokens=chunk, **engine)


def assert_prefix_hit_swap_and_drafts(path: str, **engine) -> tuple[list, list]:
    """Against a roomy run without speculation: a prompt's second run hits the prefix cache
    (cached tokens > 0, the same text); a pool too small for the batch swaps to the host tier
    while suffix drafts are verified (some accepted), and gives the same text. `engine`: more
    options for both engines. Returns the prompts and the roomy run's tokens."""
    prompts = [[(s * 31 + i * 7) % 400 + 3 for i in range(40)] for s in range(4)]
    prompts.append([7, 8, 9] * 12)  # repeats: suffix drafts get accepted
    plain = LLM(path, num_kv_blocks=256, block_size=4, num_speculative_tokens=0, **engine)
    want = [r.outputs[0].token_ids for r in plain.generate(prompts, GREEDY)]
    again = plain.generate(prompts[:2], GREEDY)
    assert [r.outputs[0].token_ids for r in again] == want[:2], path
    assert all(r.num_cached_tokens > 0 for r in again), path
    tight = LLM(
        path,
        num_kv_blocks=36,
        block_size=4,
        host_bytes="16MiB",
        preemption_mode="swap",
        num_speculative_tokens=4,
        spec_cost_model=False,
        spec_max_verify_rows=1 << 16,
        **engine,
    )
    got = [r.outputs[0].token_ids for r in tight.generate(prompts, GREEDY)]
    assert tight.engine.scheduler.num_preemptions > 0, path
    assert tight.engine.drafter.total_stats().num_accepted_tokens > 0, path
    assert got == want, path
    return prompts, want


@pytest.mark.parametrize("arch", sorted(NEW_ARCHS))
def test_hf_checkpoint_matches_transformers(arch: str, new_dirs) -> None:
    """Prefill whole and in chunks of 7 (windowed layers across chunk boundaries), decode."""
    ref = reference(new_dirs[arch])
    context = {"max_model_len": 128} if arch == "phi3" else {}  # LongRoPE's short factors
    for llm in whole_and_chunked(new_dirs[arch], **context):
        assert llm.engine.spec.architecture == NEW_ARCHS[arch][1]
        assert_matches(llm, ref)


@pytest.mark.parametrize("path", ["range", "gather", "sdpa"])
def test_gemma3_windows_on_every_torch_attention_path(path: str, new_dirs) -> None:
    """Windowed and global layers in one step on the PyTorch decode paths (range views, page
    gathers) and SDPA prefill, not only the C++ ops the default takes: a mask per window."""
    ref = reference(new_dirs["gemma3"])
    llm = LLM(str(new_dirs["gemma3"]), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16)
    backend = llm.engine.runner.backend
    assert backend.windows == [None, 8]
    assert "sliding window 8 on 5 of 6 layers" in llm.engine.info.architecture_traits
    if path == "sdpa":
        backend.prefill_op = None
    else:
        backend.decode_op = backend.rope_decode_op = None
        backend.use_range_decode = path == "range"
    assert_matches(llm, ref)


def test_speculation_stays_lossless(new_dirs) -> None:
    """Suffix drafts verified as short chunks: Gemma 3's windows and the MoE's routing per row
    give the greedy text of plain decoding."""
    prompts = [[7, 8, 9] * 9, list(range(10, 40)) * 2]
    accepted = {}
    for arch in ("gemma3", "phi3", "qwen3moe", "mixtral"):
        plain = LLM(str(new_dirs[arch]), num_kv_blocks=96, block_size=4)
        want = [r.outputs[0].token_ids for r in plain.generate(prompts, GREEDY)]
        # k pinned (no cost model): the measured verify costs of a loaded host can make drafting
        # not pay, and the check below is that drafts were verified at all
        spec = LLM(
            str(new_dirs[arch]),
            num_kv_blocks=96,
            block_size=4,
            num_speculative_tokens=4,
            spec_cost_model=False,
            spec_max_verify_rows=1 << 16,
        )
        assert [r.outputs[0].token_ids for r in spec.generate(prompts, GREEDY)] == want, arch
        accepted[arch] = spec.engine.drafter.total_stats().num_accepted_tokens
    # drafts come from repeats in the output: the random Phi-3's never repeats, the others do
    assert accepted["gemma3"] > 0 and accepted["qwen3moe"] > 0 and accepted["mixtral"] > 0


@pytest.mark.slow
@pytest.mark.main_pass_only
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_tensor_parallel_two_ranks(arch: str, new_dirs) -> None:
    """Heads and FFN columns split across two ranks (Gemma's output norms after the sum)."""
    prompts = [[(s * 31 + i * 7) % 400 + 3 for i in range(30)] for s in range(3)]
    options = dict(dtype="float32", num_kv_blocks=64, block_size=4)
    want = [
        r.outputs[0].token_ids
        for r in LLM(str(new_dirs[arch]), **options).generate(prompts, GREEDY)
    ]
    two = LLM(str(new_dirs[arch]), tensor_parallel_size=2, **options)
    try:
        assert [r.outputs[0].token_ids for r in two.generate(prompts, GREEDY)] == want
    finally:
        two.engine.shutdown()


@pytest.mark.main_pass_only
def test_tensor_parallel_refuses_experts(new_dirs) -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(str(new_dirs["mixtral"]), tensor_parallel_size=2, num_kv_blocks=64, block_size=4)


def test_phi3_long_context_takes_the_long_factors(new_dirs) -> None:
    """Served past the original context, LongRoPE's long factors for every position, as
    transformers uses them for a forward longer than the original context."""
    ref = reference(new_dirs["phi3"])
    llm = LLM(str(new_dirs["phi3"]), num_kv_blocks=96, block_size=4)
    assert llm.engine.spec.rope_scaling["use_long"]
    prompt = [(i * 7) % 500 + 3 for i in range(140)]  # past the 128-token original
    ours = score_prompt(llm.engine, prompt)
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()


def test_prefix_hit_and_preemption_by_swap_keep_outputs(new_dirs, tmp_path) -> None:
    """Every new architecture, from HF and (Gemma 3, Qwen3-MoE) from its GGUF: a prompt's second
    run hits the prefix cache, and a pool too small for the batch preempts to the host tier;
    outputs equal a roomy run's."""
    prompts = [[(s * 31 + i * 7) % 400 + 3 for i in range(40)] for s in range(6)]
    ggufs = [str(write_gguf(new_dirs[a], tmp_path / f"{a}.gguf")) for a in ("gemma3", "qwen3moe")]
    for path in [*(str(new_dirs[a]) for a in ("gemma3", "phi3", "qwen3moe", "mixtral")), *ggufs]:
        roomy = LLM(path, num_kv_blocks=256, block_size=4)
        want = [r.outputs[0].token_ids for r in roomy.generate(prompts, GREEDY)]
        again = [r.outputs[0].token_ids for r in roomy.generate(prompts[:2], GREEDY)]
        assert again == want[:2] and roomy.engine.kv.hits_by_source["device"] > 0
        tight = LLM(
            path, num_kv_blocks=40, block_size=4, host_bytes="16MiB", preemption_mode="swap"
        )
        got = [r.outputs[0].token_ids for r in tight.generate(prompts, GREEDY)]
        assert tight.engine.scheduler.num_preemptions > 0
        assert got == want, path


@pytest.mark.parametrize("arch", sorted(set(NEW_ARCHS) - {"gemma3-scaled"}))
def test_gguf_written_from_the_weights_matches_transformers(arch: str, new_dirs, tmp_path) -> None:
    """The GGUF as llama.cpp's converter writes it, float32: transformers' own GGUF reader and
    kvserve agree with the HF checkpoint."""
    path = write_gguf(new_dirs[arch], tmp_path / f"{arch}.gguf")
    ref = reference(new_dirs[arch])
    if arch != "mixtral":  # transformers reads a `llama` GGUF with experts as a dense Llama
        # The tensors as transformers' GGUF reader takes them, under the fields its reader
        # drops or defaults (Gemma 3's softmax scale as 256, Phi-3's LongRoPE and partial
        # rotary, Qwen3-MoE's expert width): those are checked against kvserve's reading below
        dropped = {
            "gemma3": ["query_pre_attn_scalar"],
            "phi3": ["pad_token_id", "rope_parameters", "original_max_position_embeddings"],
            "qwen3moe": ["moe_intermediate_size"],
        }[arch]
        fix = {key: getattr(ref.config, key) for key in dropped}
        prompt = torch.tensor([PROMPTS[1]])
        with torch.no_grad():
            want = ref(prompt).logits
            via_gguf = reference(tmp_path, gguf_file=path.name, **fix)(prompt).logits
        assert (via_gguf - want).abs().max().item() < 1e-4 * want.abs().max().item()
    context = {"max_model_len": 128} if arch == "phi3" else {}
    llm = LLM(str(path), num_kv_blocks=96, block_size=4, **context)
    assert llm.engine.spec.architecture == NEW_ARCHS[arch][1]
    assert_matches(llm, ref, PROMPTS[:2])


def test_gguf_mistral3_reads_as_mistral(tmp_path) -> None:
    """llama.cpp names Mistral Small 3 / Ministral text models `mistral3`: Llama's tensors,
    q/k rows permuted the same way."""
    from tests.conftest import build_model

    hf = build_model("mistral", tmp_path / "mistral", sliding_window=None)
    path = write_gguf(hf, tmp_path / "mistral3.gguf", arch="mistral3")
    llm = LLM(str(path), num_kv_blocks=96, block_size=4)
    assert llm.engine.spec.architecture == "MistralForCausalLM"
    assert_matches(llm, reference(hf), PROMPTS[:2])


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe"])
def test_gguf_q8_0_blocks_serve_every_matrix(arch: str, new_dirs, tmp_path) -> None:
    """Q8_0 blocks served as stored, experts' 2-D slices of the stacked tensors too: the same
    greedy text as the file's float32 dequantization."""
    from models.linear.gguf_linear import gguf_weights

    path = write_gguf(new_dirs[arch], tmp_path / f"{arch}.q8_0.gguf", "Q8_0")
    served = LLM(str(path), num_kv_blocks=96, block_size=4)
    dense = LLM(str(path), num_kv_blocks=96, block_size=4, quantization="none")
    blocks = list(gguf_weights(served.engine.model))
    layers = served.engine.spec.layers
    experts = sum(lay.num_experts for lay in layers)
    dense_ffns = sum(1 for lay in layers if not lay.num_experts)
    assert len(blocks) == 2 * len(layers) + 2 * (experts + dense_ffns) + 1  # + the head
    want = [r.outputs[0].token_ids for r in dense.generate(PROMPTS, GREEDY)]
    assert [r.outputs[0].token_ids for r in served.generate(PROMPTS, GREEDY)] == want


@pytest.mark.main_pass_only
def test_qwen3_moe_dense_layers_by_config() -> None:
    """`mlp_only_layers` and `decoder_sparse_step` leave layers dense (llama.cpp's `qwen3moe`
    has no such layers, so this shape is HF only)."""
    from models.loader import llama_layers

    experts = NEW_ARCHS["qwen3moe"][2] | dict(num_experts=8)
    cfg = BASE | experts | dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    layers = llama_layers(cfg, 16)
    assert [lay.num_experts for lay in layers] == [0, 8, 0, 0, 0, 8]
    assert [lay.intermediate_size for lay in layers] == [128, 32, 128, 128, 128, 32]


def test_a_decode_step_reads_only_the_chosen_experts(new_dirs) -> None:
    """Batch-1 decode multiplies exactly top_k of the six experts, one row each."""
    llm = LLM(str(new_dirs["qwen3moe"]), num_kv_blocks=64, block_size=4)
    moe = llm.engine.model.layers[0].moe
    steps: list[list[int]] = []  # per forward of the layer: rows each expert multiplied
    hooks = [moe.router.register_forward_pre_hook(lambda m, a: steps.append([]))]
    hooks += [
        e.gate_up_proj.register_forward_pre_hook(lambda m, a: steps[-1].append(a[0].shape[0]))
        for e in moe.experts
    ]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([list(range(5, 17))], params)
    finally:
        for h in hooks:
            h.remove()
    assert len(moe.experts) == 6 and moe.top_k == 2
    assert "6 experts, 2 a token, in 2 of 2 layers" in llm.engine.info.architecture_traits
    prefill, *decode = steps
    assert sum(prefill) == 12 * 2 and len(decode) == 3
    assert all(rows == [1, 1] for rows in decode)


# Gemma's chat template in outline: system folded into the first user turn, roles that must
# alternate (else raise_exception), "model" for the assistant, no tools
GEMMA_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\\n"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}<end_of_turn>\\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\\n{% endif %}"
)


@pytest.mark.main_pass_only
def test_parallel_tool_results_render_under_a_template_that_wants_alternation(tmp_path) -> None:
    """A template without tools gets the fallback (tool list in the system prompt, results as
    <tool_response> blocks in a user turn): the results of parallel calls, and the user turn
    after them, go in one turn, so Gemma's alternation check passes."""
    from models.tokenizer import load_tokenizer
    from server.flow.chat_plan import chat_tools, chat_turns
    from server.flow.chat_prompt import render_prompt
    from server.flow.conversation import Conversation
    from server.protocol.openai import ChatMessage, ChatTool

    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": GEMMA_STYLE})
    )
    tok = load_tokenizer(str(tmp_path))
    call = {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "id": "a"}, {**call, "id": "b"}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "10:00"},
        {"role": "tool", "tool_call_id": "b", "content": "17:00"},
        {"role": "user", "content": "And which is later?"},
    ]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    turns = chat_turns([ChatMessage.model_validate(m) for m in messages])
    tools = chat_tools([ChatTool.model_validate(tool)], None)
    ids = render_prompt(tok, Conversation(turns, "messages"), tools)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.count("<start_of_turn>user") == 2 and text.count("<start_of_turn>model") == 2
    assert "<tool_response>\n10:00\n</tool_response>\n<tool_response>\n17:00" in text
    assert "get_time" in text.split("<start_of_turn>model")[0]  # the fallback's tool list


def test_gemma3_windowed_blocks_go_back_while_the_request_runs(new_dirs) -> None:
    """A 120-token prompt through a window of 8 in blocks of 4, decoded 16 tokens: the windowed
    layers' table holds at most the window's blocks plus a step's, the blocks behind it are
    returned mid-request (counted), the output is still transformers', and both pools are
    whole again afterwards."""
    ref = reference(new_dirs["gemma3"])
    llm = LLM(
        str(new_dirs["gemma3"]),
        num_kv_blocks=96,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    kv = llm.engine.kv
    assert kv.window is not None and "a pool of their own" in llm.engine.info.window_kv
    caches = llm.engine.runner.backend.kv_caches
    # four sequences' windows (3 blocks each), two steps' 16 tokens (4 each), the null block
    assert caches[0].shape[2] == kv.window.pool.num_blocks == 4 * 3 + 2 * 4 + 1
    assert caches[5].shape[2] == 96
    live: list[int] = []
    step = llm.engine.step

    def counting_step():
        out = step()
        live.append(kv.window.num_live_blocks())
        return out

    llm.engine.step = counting_step  # type: ignore[method-assign]
    prompt = [(i * 7) % 500 + 3 for i in range(120)]
    (res,) = llm.generate([prompt], GREEDY)  # prefilled in chunks of 16
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert res.outputs[0].token_ids == gen[0, len(prompt) :].tolist()
    # the window (8 tokens: 2-3 blocks) plus a 16-token chunk (4 blocks), one block of slack
    assert 0 < max(live) <= 8
    assert kv.window.num_reclaimed >= (120 + 16 - 8) // 4 - 8
    assert kv.window.pool.num_free_blocks == kv.window.pool.num_blocks - 1  # the null block


def test_a_fixed_budget_admits_more_gemma3_requests_with_reclamation(new_dirs) -> None:
    """The same KV memory, with and without the windowed layers' own pool: the full-context
    pool gets the memory the windowed layers no longer hold, so more long requests fit."""
    budget = dict(
        kv_cache_memory="1MiB",
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        target_step_ms=-1,
    )
    on = LLM(str(new_dirs["gemma3"]), **budget)
    off = LLM(str(new_dirs["gemma3"]), reclaim_window_blocks=False, **budget)
    assert off.engine.kv.window is None and "--no-reclaim" in off.engine.info.window_kv
    # one layer in six holds every token; the window pool (8 windows and two 64-token steps)
    # takes the rest of what the five others had
    assert on.engine.num_blocks > 2 * off.engine.num_blocks
    prompts = [[(s * 31 + i * 7) % 400 + 3 for i in range(200)] for s in range(8)]
    # long enough answers that all eight run at once though their prompts are prefilled one
    # after the other (by deadline, 64 tokens a step)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for name, llm in (("on", on), ("off", off)):
        outputs[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    # eight 240-token requests: the reclaimed pool runs them without a preemption, the other
    # pool (170 blocks, 60 a request) preempts and recomputes; the same tokens either way
    assert on.engine.scheduler.num_preemptions == 0 < off.engine.scheduler.num_preemptions
    assert outputs["on"] == outputs["off"]


def test_windows_never_leave_the_full_context_pool_less_than_a_sequence(new_dirs) -> None:
    """A budget too small for every running sequence's window beside one full-length sequence:
    the window pool is never larger than the full-context pool (a request's window table is
    never longer than its full one), rather than leaving the full-context layers a block or two
    (every long prompt then refused)."""
    from engine.build.window import block_bytes
    from engine.kv.window import window_pool_blocks
    from models.loader import load_spec

    spec = load_spec(str(new_dirs["gemma3"]))
    full, win = block_bytes(spec, 4, 4)  # float32 blocks of 4 tokens
    windows = [window_pool_blocks(n, spec.sliding_window, 4, 64, 1 << 30) for n in (1, 64)]
    full_length = 64 * full  # 256 tokens
    budget = windows[0] * win + 4 * full_length  # well short of 64 windows beside one sequence
    assert budget < windows[1] * win + full_length
    llm = LLM(
        str(new_dirs["gemma3"]),
        kv_cache_memory=str(budget),
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        target_step_ms=-1,
    )
    kv = llm.engine.kv
    assert kv.window is not None and kv.window.pool.num_blocks < windows[1]
    assert kv.window.pool.num_blocks <= llm.engine.num_blocks + 1  # its null block
    assert llm.engine.num_blocks * 4 >= 256  # a full-length sequence fits
    prompt = [(i * 7) % 400 + 3 for i in range(240)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
