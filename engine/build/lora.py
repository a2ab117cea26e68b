"""The LoRA phase of a build: the limits, and the adapters `--lora-modules` names, read and
checked against the model before the engine serves anything (a bad file stops the start with
its reason)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, lora_modules
from engine.lora.registry import LoRALimits, LoRARegistry
from models.lora import LoRAError
from models.spec import ModelSpec


def build_loras(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> LoRARegistry:
    """Off (max_loras 0) under tensor parallelism: a rank holds a shard of each projection, and
    an adapter's A and B would have to be split along with it."""
    modules = lora_modules(config.lora_modules)
    max_loras = config.max_loras
    if config.tensor_parallel_size > 1:
        if modules:
            raise ValueError(
                "lora_modules with tensor_parallel_size > 1: LoRA adapters are "
                "served by one rank (they are not split across ranks)"
            )
        max_loras = 0
    if spec.group_specs:  # DeepSeek V4: its own layers, whose projections take no adapter rows
        if modules:
            raise ValueError(
                f"lora_modules with {spec.architecture}: its layers do not take LoRA adapters"
            )
        max_loras = 0
    if modules and max_loras == 0:
        raise ValueError("lora_modules with max_loras 0: nothing could serve them")
    registry = LoRARegistry(LoRALimits(max_loras, config.max_lora_rank), spec, dtype)
    for name, path in modules.items():
        try:
            registry.add(name, registry.read(path))
        except LoRAError as e:
            raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    return registry
