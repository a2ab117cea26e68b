"""Seeded synthetic chat prompts of controlled token lengths, shared by the benchmarks."""

from __future__ import annotations

import random

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more what up out about who them some could into time only new like other then these over "
    "kv cache memory block prefix server model token batch decode prefill attention layer"
).split()


def chat_prompts(tokenizer, n: int, prompt_range=(32, 512), output_range=(32, 256), seed=0):
    """[(prompt_token_ids, max_new_tokens)]: chat-templated user turns of the target length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(*prompt_range)
        words: list[str] = []
        ids: list[int] = []
        while True:
            words.extend(rng.choice(WORDS) for _ in range(8))
            text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}])
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= target:
                break
        out.append((ids, rng.randint(*output_range)))
    return out
