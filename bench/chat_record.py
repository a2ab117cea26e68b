"""What the prefix-cache benchmarks keep of one completed chat completion stream."""

from __future__ import annotations

from harness import sse


def chat_record(s: sse.Stream) -> dict[str, float]:
    """`s`'s TTFT (its end-to-end time when no content came) and, from the usage it ended with,
    its prompt, cached prompt and completion tokens."""
    assert s.usage is not None, "a completed stream ends with its usage"
    return {
        "ttft": s.ttft if s.ttft is not None else s.e2e,
        "prompt": s.usage["prompt_tokens"],
        "cached": s.usage["prompt_tokens_details"]["cached_tokens"],
        "completion": s.usage["completion_tokens"],
    }
