"""kvserve's engine: paged KV cache, prefix cache, continuous batching."""

from engine.config import EngineConfig
from engine.core.outputs import CompletionOutput, GenerationResult, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM

__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "GenerationResult",
]
