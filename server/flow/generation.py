"""Turning engine outputs into OpenAI fields: the choices of a request, logprobs in both APIs'
shapes, usage. No HTTP here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.images import PromptImage
from engine.core.outputs import RequestOutput
from engine.core.sampled import TokenLogprobs
from engine.core.sampling_params import SamplingParams
from models.tokenizer import Tokenizer


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_blocks: list[tuple[bytes, bytes]] | None = None  # exported at its end (disaggregation)
    embedding: torch.Tensor | None = None  # an embedding request's pooled vector
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the prompt's, when scored
    # the application to count the prompt's cache hit for, until its first output has
    app: str | None = None
    images: tuple[PromptImage, ...] = ()  # its prompt's images (engine/core/images.py)

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.kv_blocks = out.kv_blocks


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop / length; an abort that reaches a client was a stop for it."""
    if reason in (None, "stop", "length"):
        return reason
    return "stop"


def token_str(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    content = []
    for e in entries:
        s = token_str(tokenizer, e.token_id)
        content.append(
            {
                "token": s,
                "logprob": max(e.logprob, -9999.0),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {
                        "token": (t := token_str(tokenizer, i)),
                        "logprob": max(lp, -9999.0),
                        "bytes": list(t.encode()),
                    }
                    for i, lp in e.top
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs | None], token_ids: list[int], offset: int
) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for token_id, e in zip(token_ids, entries, strict=True):
        s = token_str(tokenizer, token_id)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(max(e.logprob, -9999.0))
            tops.append({token_str(tokenizer, i): max(lp, -9999.0) for i, lp in e.top})
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage_of(choices: list[Choice], n: int) -> dict:
    """Usage of a request's choices: each prompt counted once (its first choice), every
    choice's completion."""
    firsts = choices[::n]
    return usage(
        sum(len(c.prompt_ids) for c in firsts),
        sum(len(c.token_ids) for c in choices),
        sum(c.num_cached_tokens for c in firsts),
        sum(image.num_tokens for c in firsts for image in c.images),
    )


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, image_tokens: int = 0
) -> dict:
    """OpenAI's usage; a prompt's images' soft tokens are among its prompt tokens, and counted
    apart as `image_tokens` where it has any."""
    details: dict = {"cached_tokens": cached_tokens}
    if image_tokens:
        details["image_tokens"] = image_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }
