"""Self-distillation data for an EAGLE head, at scale: the target writes its own questions
(self-instruct) and answers them, greedy and sampled, with kvserve's batched engine.

    python -m tools.eagle_data --out DIR [--questions-per-pair 4] [--seed 0]

1. Questions: for every training subject (`models.eagle.prompts.SUBJECTS`; the held-out
   subjects never appear) x answer format (lists, code, dialogue, JSON, long explanations, ...),
   the target is asked, sampling, to write a user question; duplicates and questions naming a
   held-out subject are dropped. The fixed template prompts are added.
2. Answers: each question answered greedily, or (a `--sampled-share`) at temperature 0.8.
3. Written to DIR as it goes: `questions.jsonl` once the questions are written, then a shard
   of answers every `--shard-size` questions (`shard-0000.pt`, ...): a run started again on the
   same DIR reuses the questions and the shards it finds, so an interruption loses at most one
   shard. At the end `data.pt` (what `tools.eagle_train --data` reads: (token ids, first answer
   index) per sequence, the shards in order) and `manifest.json` (counts, tokens, seconds,
   tokens per hour on this machine). Same seed, same data.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from models.eagle.prompts import HELDOUT_SUBJECTS, SUBJECTS, train_prompts
from tools.eagle_train import generate_data

FORMATS = [
    "a numbered list",
    "a short Python function with a docstring",
    "a dialogue between two people",
    "a JSON object",
    "a detailed explanation in several paragraphs",
    "one or two sentences",
    "step-by-step instructions",
    "a comparison of two options",
    "a short email",
    "a short story",
    "a markdown table",
    "a summary with a title and bullet points",
]


def question_prompt(subject: str, fmt: str) -> str:
    return (
        f"Write one question that a curious user might ask an assistant about {subject}. "
        f"The best answer to it would be {fmt}. Reply with the question only."
    )


def clean_question(text: str) -> str | None:
    line = text.strip().split("\n")[0].strip().strip('"').strip()
    if not 15 <= len(line) <= 300:
        return None
    lowered = line.lower()
    if any(s.lower() in lowered for s in HELDOUT_SUBJECTS):
        return None  # the held-out split is by subject
    return line


def write_questions(llm: LLM, per_pair: int) -> list[str]:
    pairs = [(s, f) for s in SUBJECTS for f in FORMATS for _ in range(per_pair)]
    convs = [[{"role": "user", "content": question_prompt(s, f)}] for s, f in pairs]
    # unseeded rows sample in one batched draw (per-request generators draw row by row); the
    # engine's own seed (`LLM(seed=...)`) keeps the run reproducible
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64)
    results = llm.chat(convs, params, use_tqdm=True)  # type: ignore[arg-type]
    seen: set[str] = set()
    out = []
    for r in results:
        q = clean_question(r.outputs[0].text)
        if q is not None and q.lower() not in seen:
            seen.add(q.lower())
            out.append(q)
    return out


def answer_in_shards(
    llm: LLM,
    questions: list[str],
    out: Path,
    shard_size: int,
    max_tokens: int,
    sampled_share: float,
    seed: int,
) -> list[tuple[list[int], int]]:
    """Every question's (token ids, first answer index), `shard_size` questions a shard file in
    `out`, written whole (a rename) as each finishes; shards already there are read, not
    generated again."""
    seqs: list[tuple[list[int], int]] = []
    start = time.monotonic()
    for n, first in enumerate(range(0, len(questions), shard_size)):
        shard = out / f"shard-{n:04d}.pt"
        if not shard.exists():
            # which rows sample is seeded by the shard's index; the sampled tokens come from the
            # engine's generator, so only greedy rows repeat exactly in a restarted run
            part = generate_data(
                llm, questions[first : first + shard_size], max_tokens, sampled_share, seed + n
            )
            torch.save(part, shard.with_suffix(".partial"))
            shard.with_suffix(".partial").rename(shard)
            took = time.monotonic() - start
            print(f"{shard.name}: {len(part)} answers, {took:.0f} s", flush=True)
        seqs += torch.load(shard)
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--questions-per-pair", type=int, default=3, help="per subject x format")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sampled-share", type=float, default=0.3)
    ap.add_argument("--max-num-seqs", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=int, default=384, help="questions per shard of answers")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(
        args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, seed=args.seed
    )
    start = time.monotonic()
    asked_path = out / "questions.jsonl"
    if asked_path.exists():  # a run started again: the same questions, the shards it left
        questions = [json.loads(line) for line in asked_path.read_text().splitlines()]
    else:
        questions = write_questions(llm, args.questions_per_pair)
        questions += train_prompts(10_000, args.seed)  # every template x training subject
        random.Random(args.seed).shuffle(questions)
        partial = asked_path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(q) + "\n" for q in questions))
        partial.rename(asked_path)
    asked = time.monotonic()
    seqs = answer_in_shards(
        llm, questions, out, args.shard_size, args.max_tokens, args.sampled_share, args.seed
    )
    seconds = time.monotonic() - start
    answer_tokens = sum(len(ids) - first for ids, first in seqs)
    torch.save(seqs, out / "data.pt")
    manifest = {
        "args": vars(args),
        "dtype": llm.engine.info.dtype,
        "questions": len(questions),
        "sequences": len(seqs),
        "tokens": sum(len(ids) for ids, _ in seqs),
        "answer_tokens": answer_tokens,
        "question_seconds": round(asked - start, 1),
        "seconds": round(seconds, 1),
        "generated_tokens_per_hour": round(answer_tokens / (seconds - (asked - start)) * 3600),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
