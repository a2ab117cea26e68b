"""Self-distil an EAGLE-1 draft head for a target model, on a CPU.

    python -m tools.eagle_train --out models/eagle/heads/smollm2-135m-instruct

1. Data: the target's own answers (greedy, and a share sampled at temperature 0.8) to a fixed
   prompt set (`models.eagle.prompts`), generated with kvserve's engine. Cached in `--work`.
2. Features: one target forward per sequence; the final normed hidden state at every position.
3. Training: the head sees (embed(t_{p+1}), f_p) and predicts f_{p+1}; loss = smooth-L1 on the
   feature + 0.1 x cross-entropy of the target's next token over the draft vocabulary (EAGLE's
   recipe). A second unrolled pass feeds the head its own predicted features (detached), so it
   also learns the chained steps it runs at inference. The draft vocabulary is the most frequent
   `--draft-vocab` tokens of the answers (+ specials): the draft's lm_head is a row subset of the
   target's, 6x cheaper per draft step for SmolLM2's 49k vocabulary.
4. Saved in EAGLE-1 key names (half precision) plus `token_map` (draft row -> token id).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from collections import Counter

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from models.attention_step import AttentionStep
from models.eagle.head import EagleConfig, EagleHead, load_eagle_head
from models.eagle.prompts import train_prompts
from models.eagle.shipped import write_probe
from models.llama import LlamaForCausalLM


class PackedCausalAttention(AttentionStep):
    """Attention over packed sequences without a cache: causal within each sequence, one
    causal SDPA per sequence (one masked SDPA over the whole pack computed every pair in it,
    ~9x the work at SmolLM2's ~220-token answers in a 2,048-token pack)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        outs = []
        for qs, ks, vs in zip(*(t.transpose(0, 1).split(self.lengths, dim=1) for t in (q, k, v))):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        return torch.cat(outs, dim=1).transpose(0, 1)


def generate_data(
    llm: LLM, prompts: list[str], max_tokens: int, sampled_share: float, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, index of the first answer token) per prompt."""
    # sampled rows unseeded: one batched draw per step (a seeded row draws alone); the
    # engine's seed keeps the run reproducible
    rng = random.Random(seed)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8)
        if rng.random() < sampled_share
        else SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for _ in range(len(prompts))
    ]
    convs = [[{"role": "user", "content": p}] for p in prompts]
    results = llm.chat(convs, params, use_tqdm=True)  # type: ignore[arg-type]
    return [(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids)) for r in results]


@torch.inference_mode()
def compute_features(
    model: LlamaForCausalLM, seqs: list[tuple[list[int], int]], pack_tokens: int = 2048
) -> list[torch.Tensor]:
    """The target's final normed hidden state at every position of every sequence (fp16)."""
    feats: list[torch.Tensor] = []
    i = 0
    start = time.monotonic()
    while i < len(seqs):
        batch = [seqs[i][0]]
        while i + len(batch) < len(seqs) and sum(map(len, batch)) < pack_tokens:
            batch.append(seqs[i + len(batch)][0])
        lengths = [len(s) for s in batch]
        ids = torch.tensor([t for s in batch for t in s])
        pos = torch.cat([torch.arange(n) for n in lengths])
        hidden = model(ids, pos, PackedCausalAttention(lengths))
        feats.extend(h.half() for h in hidden.split(lengths))
        i += len(batch)
        print(f"features: {i}/{len(seqs)} sequences, {time.monotonic() - start:.0f}s", flush=True)
    return feats


def draft_vocabulary(
    seqs: list[tuple[list[int], int]], size: int, specials: list[int]
) -> list[int]:
    counts = Counter(t for ids, start in seqs for t in ids[start:])
    vocab = list(dict.fromkeys(specials + [t for t, _ in counts.most_common(size)]))[:size]
    covered = sum(counts[t] for t in vocab) / max(1, sum(counts.values()))
    print(f"draft vocabulary: {len(vocab)} tokens cover {covered:.1%} of answer tokens")
    return sorted(vocab)


def new_head(model: LlamaForCausalLM, token_map: torch.Tensor) -> EagleHead:
    """A fresh EAGLE-1 head shaped like the target's last layer: small random weights, fc
    starting as the identity on the feature half, so it first predicts "same feature"."""
    spec, last = model.spec, model.spec.layers[-1]
    cfg = EagleConfig(
        "eagle1",
        spec.hidden_size,
        last.num_heads,
        last.num_kv_heads,
        last.head_dim,
        last.intermediate_size,
        spec.rms_norm_eps,
        spec.rope_theta,
        True,
        None,
        (),
    )
    head = EagleHead(cfg, model, layer_idx=0)
    h = spec.hidden_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        head.fc.weight[:, h:] += torch.eye(h)  # start as "the next feature is this one"
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
    head.set_token_map(token_map)
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def _batches(n: int, seqs: list[tuple[list[int], int]], pack: int, rng: random.Random):
    order = list(range(n))
    rng.shuffle(order)
    batch: list[int] = []
    for i in order:
        batch.append(i)
        if sum(len(seqs[j][0]) for j in batch) >= pack:
            yield batch
            batch = []
    if batch:
        yield batch


def train_head(
    head: EagleHead,
    seqs: list[tuple[list[int], int]],
    feats: list[torch.Tensor],
    epochs: int,
    lr: float,
    pack: int,
    seed: int,
    unroll_weight: float = 0.5,
    ce_weight: float = 0.1,
) -> None:
    rng = random.Random(seed)
    token_map = head.token_map
    assert token_map is not None
    to_draft = torch.full((head.embed.weight.shape[0],), -100, dtype=torch.long)
    to_draft[token_map] = torch.arange(len(token_map))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = sum(1 for _ in _batches(len(seqs), seqs, pack, random.Random(0)))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / total))
    )
    assert head.vocab_weight is not None
    vocab_weight = head.vocab_weight.float()  # the target's rows (bf16 when it serves bf16), frozen
    step, start = 0, time.monotonic()
    for epoch in range(epochs):
        for batch in _batches(len(seqs), seqs, pack, rng):
            ids_l, f_in, f_out, tok_next, mask, lengths = [], [], [], [], [], []
            for j in batch:
                ids, ans = seqs[j]
                f = feats[j].float()
                n = len(ids) - 2  # inputs p = 0..n-1 use t_{p+1}; targets f_{p+1}, t_{p+2}
                ids_l.append(torch.tensor(ids[1 : n + 1]))
                f_in.append(f[:n])
                f_out.append(f[1 : n + 1])
                tok_next.append(to_draft[torch.tensor(ids[2 : n + 2])])
                m = torch.zeros(n, dtype=torch.bool)
                m[max(0, ans - 2) :] = True  # predict answer tokens (and the template's end)
                mask.append(m)
                lengths.append(n)
            ids_t, fin = torch.cat(ids_l), torch.cat(f_in)
            fout, tnext, m = torch.cat(f_out), torch.cat(tok_next), torch.cat(mask)
            pos = torch.cat([torch.arange(n) for n in lengths])
            attn = PackedCausalAttention(lengths)
            loss = torch.zeros(())
            stats = []
            inputs = fin + (torch.rand_like(fin) - 0.5) * 0.1  # EAGLE's feature noise
            for weight in (1.0, unroll_weight):
                pred = head(ids_t, inputs, pos, attn)
                reg = F.smooth_l1_loss(pred[m], fout[m])
                logits = pred[m] @ vocab_weight.t()
                ce = F.cross_entropy(logits, tnext[m], ignore_index=-100)
                loss = loss + weight * (reg + ce_weight * ce)
                with torch.no_grad():
                    valid = tnext[m] >= 0
                    acc = (logits.argmax(-1)[valid] == tnext[m][valid]).float().mean().item()
                stats.append((reg.item(), ce.item(), acc))
                # next pass: position p sees the head's own prediction of f_p (from p-1)
                shifted = torch.cat([fin[:1], pred.detach()[:-1]])
                starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
                shifted[starts] = fin[starts]
                inputs = torch.where(m[:, None], shifted, fin)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0 or step == total:
                (r0, c0, a0), (r1, c1, a1) = stats
                print(
                    f"epoch {epoch} step {step}/{total} reg {r0:.3f}/{r1:.3f} ce {c0:.2f}/{c1:.2f}"
                    f" top1 {a0:.1%}/{a1:.1%} lr {sched.get_last_lr()[0]:.2e} "
                    f"{time.monotonic() - start:.0f}s",
                    flush=True,
                )


def save_head(head: EagleHead, model: LlamaForCausalLM, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    cfg, h, inter = head.cfg, head.cfg.hidden_size, head.cfg.intermediate_size
    q, kv = head.q_dim, head.kv_dim
    qkv = head.qkv_proj.weight.detach()
    gate_up = head.gate_up_proj.weight.detach()
    tensors = {
        "fc.weight": head.fc.weight.detach(),
        "layers.0.self_attn.q_proj.weight": qkv[:q],
        "layers.0.self_attn.k_proj.weight": qkv[q : q + kv],
        "layers.0.self_attn.v_proj.weight": qkv[q + kv :],
        "layers.0.self_attn.o_proj.weight": head.o_proj.weight.detach(),
        "layers.0.mlp.gate_proj.weight": gate_up[:inter],
        "layers.0.mlp.up_proj.weight": gate_up[inter:],
        "layers.0.mlp.down_proj.weight": head.down_proj.weight.detach(),
        "layers.0.post_attention_layernorm.weight": head.post_attention_layernorm.weight.detach(),
    }
    assert head.fc.bias is not None
    tensors["fc.bias"] = head.fc.bias.detach()
    tensors = {k: v.half().contiguous() for k, v in tensors.items()}
    assert head.token_map is not None
    tensors["token_map"] = head.token_map.to(torch.int64).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "eagle_layout": "eagle1",
        "hidden_size": h,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": model.spec.vocab_size,
        "draft_vocab_size": len(head.token_map),
        "bias": True,
        "torch_dtype": "float16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # the target it was trained for, recognised by its weights (models/eagle/shipped.py)
    write_probe(out, model.embed_tokens.weight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kvserve-eagle", help="cache for data and features")
    ap.add_argument("--data", default="", help="DIR/data.pt from tools.eagle_data")
    ap.add_argument("--num-prompts", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--sampled-share", type=float, default=0.3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pack-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-seqs", type=int, default=0, help="use only the first N (0 = all)")
    ap.add_argument("--resume", default="", help="continue training the head saved in this dir")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="token loss weight (EAGLE: 0.1)")
    ap.add_argument("--stage", choices=["data", "features", "all"], default="all")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    os.makedirs(args.work, exist_ok=True)
    llm = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=2048)
    model = llm.engine.model
    data_path = os.path.join(args.work, f"data-{args.num_prompts}-{args.max_tokens}.pt")
    if args.data:  # tools.eagle_data's sequences
        data_path = args.data
        seqs = torch.load(data_path)
    elif os.path.exists(data_path):
        seqs = torch.load(data_path)
    else:
        prompts = train_prompts(args.num_prompts, args.seed)
        seqs = generate_data(llm, prompts, args.max_tokens, args.sampled_share, args.seed)
        torch.save(seqs, data_path)
    if args.train_seqs:
        seqs = seqs[: args.train_seqs]
    print(f"{len(seqs)} sequences, {sum(len(s) for s, _ in seqs)} tokens")
    if args.stage == "data":
        return
    tag = hashlib.sha256(os.path.abspath(data_path).encode()).hexdigest()[:8]
    feat_path = os.path.join(args.work, f"features-{tag}-{len(seqs)}.pt")
    if os.path.exists(feat_path):
        feats = torch.load(feat_path)
    else:
        feats = compute_features(model, seqs, args.pack_tokens)
        torch.save(feats, feat_path)
    if args.stage == "features":
        return
    tok = llm.tokenizer
    specials = sorted(llm.engine.eos_token_ids) + (
        [t for t in (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")) if t]
        if tok
        else []
    )
    if args.resume:
        head = load_eagle_head(args.resume, model, torch.float32, torch.device("cpu"))
        for p in head.parameters():
            p.requires_grad_(True)
    else:
        token_map = torch.tensor(draft_vocabulary(seqs, args.draft_vocab, specials))
        head = new_head(model, token_map)
    train_head(
        head,
        seqs,
        feats,
        args.epochs,
        args.lr,
        args.pack_tokens,
        args.seed,
        ce_weight=args.ce_weight,
    )
    save_head(head, model, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
