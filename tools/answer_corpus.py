"""The answer corpus that corpus drafts read (engine/spec/answer_corpus.py): the target answers
every training prompt (`models.eagle.prompts.train_prompts`: templates x subjects; the held-out
subjects `bench/speculative.py` measures on never appear), greedily, with kvserve's batched
engine, and the answers are written with their suffix array beside the shipped head, whose
`target_probe.json` keys the corpus to the model's weights like the head.

    python -m tools.answer_corpus [--model PATH] [--out DIR] [--prompts N] [--max-tokens 256]

Default: the default model and its shipped head directory. Same prompts, same corpus.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.spec.answer_corpus import write_corpus
from models.eagle.prompts import HELDOUT_SUBJECTS, SUBJECTS, TEMPLATES, train_prompts
from models.eagle.shipped import shipped_head_for, write_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="default: the shipped head trained for the model")
    ap.add_argument("--prompts", type=int, default=len(SUBJECTS) * len(TEMPLATES))
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    assert not set(SUBJECTS) & set(HELDOUT_SUBJECTS), "a held-out subject is in the training set"
    llm = LLM(model=a.model, num_speculative_tokens=8, enable_prefix_caching=True)
    embed = llm.engine.runner.model.embed_tokens.weight
    out = a.out or shipped_head_for(embed)
    if out is None:
        raise SystemExit("no shipped head matches this model: name --out")
    prompts = train_prompts(a.prompts)
    start = time.monotonic()
    results = llm.chat(
        [[{"role": "user", "content": p}] for p in prompts],
        SamplingParams(max_tokens=a.max_tokens, temperature=0.0),
        use_tqdm=True,
    )
    seconds = time.monotonic() - start
    answers = [r.outputs[0].token_ids for r in results]
    manifest = write_corpus(
        out,
        answers,
        {
            "prompts": len(prompts),
            "max_tokens": a.max_tokens,
            "greedy": True,
            "seconds": round(seconds, 1),
            "model": a.model or "the default model",
        },
    )
    if not Path(out, "target_probe.json").is_file():
        write_probe(out, embed)
    print(f"{manifest['answers']} answers, {manifest['tokens']} tokens in {seconds:.0f} s -> {out}")


if __name__ == "__main__":
    main()
