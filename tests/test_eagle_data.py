"""The EAGLE tools: tools/eagle_data.py writes its answers in shards as it goes (a run started
again on the same directory reads the shards it finds and generates only the missing ones), and
tools/eagle_train.py's packed attention keeps each sequence to its own past."""

from __future__ import annotations

import torch

import tools.eagle_data as eagle_data
from engine import LLM


def test_answers_come_back_in_order_and_a_restart_regenerates_only_what_is_missing(
    llama_dir, tmp_path, monkeypatch
) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=128, block_size=4)
    questions = [f"question number {i} about the sea" for i in range(5)]
    args = dict(shard_size=2, max_tokens=6, sampled_share=0.0, seed=0)
    first = eagle_data.answer_in_shards(llm, questions, tmp_path, **args)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shard-000{i}.pt" for i in range(3)]
    assert len(first) == 5
    for (ids, start), q in zip(first, questions):
        prompt = llm.tokenizer.decode(ids[:start])
        assert q in prompt and 0 < len(ids) - start <= 6

    (tmp_path / "shard-0001.pt").unlink()
    asked: list[list[str]] = []
    real = eagle_data.generate_data
    monkeypatch.setattr(
        eagle_data, "generate_data", lambda llm, qs, *a: asked.append(qs) or real(llm, qs, *a)
    )
    again = eagle_data.answer_in_shards(llm, questions, tmp_path, **args)
    assert asked == [questions[2:4]]  # the missing shard alone
    assert again == first  # greedy rows: the same answers
    assert torch.load(tmp_path / "shard-0001.pt") == first[2:4]


def test_packed_attention_is_causal_within_each_sequence_alone() -> None:
    """The training's packed attention (one causal SDPA per sequence) equals attention under
    the mask that keeps each position to its own sequence's past (GQA 3:1)."""
    import torch.nn.functional as F

    from tools.eagle_train import PackedCausalAttention

    torch.manual_seed(0)
    lengths = [5, 9, 1, 3]
    n = sum(lengths)
    q, k, v = torch.randn(n, 6, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    got = PackedCausalAttention(lengths).forward(0, q, k, v)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(m) for m in lengths])
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    torch.testing.assert_close(got, want)
