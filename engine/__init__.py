"""kvserve's engine: paged KV cache, prefix cache, continuous batching."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, GenerationResult, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "GenerationResult",
]
