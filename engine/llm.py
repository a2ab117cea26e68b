"""The offline API in vLLM's shape: `LLM(model=...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import CompletionOutput, GenerationResult
from engine.core.sampling_params import SamplingParams

# vLLM's prompt forms: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}
Prompt = str | list[int] | Mapping[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_overrides: Any) -> None:
        unknown = set(engine_overrides) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_overrides))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release what the engine holds outside this process's memory (tensor-parallel ranks,
        their process group and shared memory; the host tier's flush to disk). A dropped `LLM`
        releases its ranks when collected; `with LLM(...) as llm:` releases all at the end."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, Mapping):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise ValueError(
                    "a dict prompt needs exactly one of 'prompt' (text) or 'prompt_token_ids'; "
                    f"got keys {sorted(prompt)}"
                )
            return self._encode(prompt[keys.pop()])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise ValueError(
            "a prompt is a string, a list of token ids, {'prompt': str} or "
            f"{{'prompt_token_ids': list[int]}}; got {type(prompt).__name__}: {prompt!r:.80}"
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        order: list[str] = []
        results: dict[str, GenerationResult] = {}
        try:
            self._add_all(prompts, params_list, order, results)
            self._run(order, results, use_tqdm)
        except BaseException:
            for rid in order:  # leave nothing behind in the engine for the next call
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]

    def _add_all(
        self,
        prompts: Sequence[Prompt],
        params_list: list[SamplingParams],
        order: list[str],
        results: dict[str, GenerationResult],
    ) -> None:
        for prompt, params in zip(prompts, params_list, strict=True):
            rid = str(next(self._ids))
            ids = self._encode(prompt)  # type: ignore[arg-type]
            self.engine.validate_prompt(ids, params)
            self.engine.add_request(rid, ids, params)
            order.append(rid)
            results[rid] = GenerationResult(
                rid,
                ids,
                [CompletionOutput(0, "", [], None, [] if params.logprobs is not None else None)],
            )

    def _run(self, order: list[str], results: dict[str, GenerationResult], use_tqdm: bool) -> None:
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.request_id]
                comp = res.outputs[0]
                comp.token_ids.extend(out.new_token_ids)
                comp.text += out.new_text
                if comp.logprobs is not None:
                    comp.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    comp.prompt_logprobs = out.prompt_logprobs
                res.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                    bar.update(1)
        bar.close()

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None
    ) -> list[torch.Tensor]:
        """One L2-normalised embedding (float32) per prompt: the pooled final hidden state
        (engine/runner/pooling.py), batched through the engine like prefills. `pooling`: "last" or
        "mean"; None: the engine's (`EngineConfig.pooling`, resolved from the checkpoint)."""
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params = SamplingParams(max_tokens=1, pooling=pooling or self.engine.info.pooling)
        order: list[str] = []
        vectors: dict[str, torch.Tensor] = {}
        try:
            for prompt in prompts:
                rid = str(next(self._ids))
                ids = (
                    self.tokenizer.encode_for_embedding(prompt)
                    if isinstance(prompt, str) and self.tokenizer is not None
                    else self._encode(prompt)  # type: ignore[arg-type]
                )
                self.engine.validate_prompt(ids, params)
                self.engine.add_request(rid, ids, params)
                order.append(rid)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    if out.embedding is not None:
                        vectors[out.request_id] = out.embedding
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [vectors[rid] for rid in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[Prompt] = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv), add_special_tokens=False
            )  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
