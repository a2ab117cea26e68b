"""Random PEFT LoRA adapters for the tiny test models, made by `peft` itself, and PEFT's merged
model in `transformers` as the reference the engine's outputs are checked against."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out: Path,
    seed: int,
    targets: list[str] | None = None,
    r: int = 4,
    alpha: int = 8,
    **config: object,
) -> Path:
    """A PEFT adapter on `base_dir` with random A and B (std 0.2: PEFT's own init leaves B
    zero, an adapter that changes nothing), saved as PEFT saves one."""
    import transformers
    from peft import LoraConfig, get_peft_model

    if out.exists():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, **config)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out)
    return out


def merged_model(base_dir: Path, adapter: Path | None):
    """The base model in float32, with `adapter` merged into its weights by PEFT."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """(n greedy tokens, the prompt's next-token log-probabilities [len(prompt), vocab])."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logprobs = model(ids).logits[0].float().log_softmax(-1)
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist(), logprobs
