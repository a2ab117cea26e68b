"""The weights phase of a build, the same on every tensor-parallel rank: refuse what cannot serve
here before anything loads, load this rank's shard, keep a GGUF's blocks as stored, pack the
dense linears, and measure which path serves how many rows. `weights_key` is the one identity
of "these weights under these settings" that every startup memo is keyed by."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.attention.matrix import dtype_name
from engine.config import EngineConfig
from engine.weights.quantization import WEIGHT_ONLY, serve_gguf_blocks
from models.fp8_weights import dequantized_note
from models.linear import gguf_linear, measure
from models.linear.dense import onednn_pack_refusal
from models.linear.layer import pack_linears
from models.linear.w8a8 import can_quantize
from models.llama import LlamaForCausalLM
from models.loader import load_model
from models.spec import ModelSpec
from models.tp_plan import RankShard

log = logging.getLogger("kvserve.engine")


def weights_key(config: EngineConfig, model_path: str, dtype: torch.dtype) -> tuple:
    """What a measurement on these weights depends on, up to the kernels and the threads: an
    engine built again in this process on the same file and settings (tests, notebooks, a
    second engine beside the first) reuses what the first measured."""
    return (
        os.path.abspath(model_path),
        os.path.getmtime(model_path),
        str(dtype),
        config.quantization,
        config.gguf_int8_activations,
        config.gguf_int8_prefill,
        config.cpu_packed_weights,
        torch.get_num_threads(),
        config.tensor_parallel_size,
        config.spec_max_verify_rows,
    )


def int8_activations(config: EngineConfig) -> bool:
    """Whether the block kernel may round activations to int8 (`--gguf-int8-activations`).
    auto under tensor parallelism: no (the accuracy judge runs on one rank's model only)."""
    setting = config.gguf_int8_activations
    return setting == "on" or (setting == "auto" and config.tensor_parallel_size == 1)


def int8_prefill(config: EngineConfig) -> bool:
    """Whether the GGUF weights' dense path may take int8 W8A8 copies (`--gguf-int8-prefill`):
    measured and judged on rank 0's model in the quantize phase, so not under tensor
    parallelism (`on` is refused there by the config)."""
    return config.gguf_int8_prefill != "off" and config.tensor_parallel_size == 1


def refuse_before_loading(config: EngineConfig, device: torch.device) -> None:
    """What cannot serve here is refused before the weights load (minutes for a large model)."""
    if config.quantization == "int8" and (why_not := can_quantize(device)) is not None:
        raise ValueError(f"--quantization int8: {why_not}")
    if config.quantization in WEIGHT_ONLY and (device.type != "cpu" or gguf_linear.load() is None):
        raise ValueError(
            f"--quantization {config.quantization}: the block kernel is a CPU path and needs "
            "kvserve's C++ ops (a compiler); serve the float model instead"
        )


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A rank's model as it serves: `spec` is the whole model's geometry, `local` this rank's
    part (its heads and FFN columns; the whole model without tensor parallelism); `notes` what
    the banner's weights line says."""

    model: LlamaForCausalLM
    spec: ModelSpec
    local: ModelSpec
    shard: RankShard | None
    notes: str
    packed_bytes: int


def load_weights(
    config: EngineConfig,
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    shard_of: Callable[[ModelSpec], RankShard] | None,
) -> LoadedWeights:
    """Load, keep GGUF blocks as stored, pack and measure, for this rank (`shard_of`: its part
    of a spec under tensor parallelism)."""
    torch.manual_seed(config.seed)
    vision = None
    if config.mmproj:  # its image side, checked against the text model before that is read
        from models.mmproj import mmproj_vision_spec  # imports `gguf`: GGUF serving only

        vision = mmproj_vision_spec(config.mmproj, model_path)
    model, spec = load_model(model_path, dtype, device, shard_of, config.max_model_len)
    if vision is not None:
        spec = replace(spec, vision=vision)
    shard = shard_of(spec) if shard_of is not None else None
    notes = f"{dtype_name(dtype)} (the serving dtype)"
    if fp8_note := dequantized_note(model_path, model):  # no FP8 matmul: say what it costs
        notes = f"{fp8_note}; {notes}"
    gguf_note, gguf_served = "", False
    if config.quantization == "auto":
        gguf_note, gguf_served = serve_gguf_blocks(model, model_path, spec, device, shard)
    packed_bytes = 0
    if config.cpu_packed_weights:
        packed_bytes = pack_linears(model)
        if device.type == "cpu" and (refusal := onednn_pack_refusal(dtype)) is not None:
            log.warning("no oneDNN-packed weights for %s here: %s", dtype_name(dtype), refusal)
            notes += f"; unpacked: oneDNN refuses packed {dtype_name(dtype)} here ({refusal})"
        elif device.type == "cpu" and (rows := measure.measure_packed_rows(model)):
            log.info("linear layers: %s", rows)
            notes += f"; {rows}"
    if gguf_served:  # measured with the dense copies in place
        key = weights_key(config, model_path, dtype)
        crossover = measure.measure_crossover(
            model, dtype, int8_activations(config), key, config.spec_max_verify_rows
        )
        log.info("GGUF block kernel against the dense path: %s", crossover)
        gguf_note += f"; {crossover}"
    if gguf_note:
        notes = f"{gguf_note}; other weights {notes}"
    local = shard.spec if shard is not None else spec
    return LoadedWeights(model, spec, local, shard, notes, packed_bytes)
