"""The engine's typed configuration. Field names are the `config.toml` keys, the `LLM(...)`
keyword arguments and (with dashes) the command-line flags."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.attention.matrix import DeviceFacts


def parse_bytes(value: str | int) -> int:
    """'8GiB', '512MiB', '1.5GB', or a plain integer."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse a byte size from {value!r}")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = " KMGT".index(unit or " ")
    return int(number * (1024 if binary else 1000) ** power)


# the host tier a disk tier or a remote store needs when host_bytes is 0: both hang under it
# (blocks reach the disk through it, and received ones land in it), so without one they'd do
# nothing
DEFAULT_HOST_BYTES = "1GiB"


DTYPE_NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def auto_dtype(device: torch.device, capability: tuple[int, int] | None = None) -> torch.dtype:
    """On CUDA bfloat16 from sm80 (Ampere) on, float16 below (Turing and Volta have no bfloat16
    tensor cores, and FlashInfer's bf16 kernels need sm80). On CPU float32 here: the CPU's
    choice needs the startup probe and the checkpoint (`choose_dtype`)."""
    if device.type != "cuda":
        return torch.float32
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if tuple(capability) >= (8, 0) else torch.float16


def choose_dtype(
    requested: str,
    device: torch.device,
    facts: DeviceFacts | None = None,
    checkpoint_dtype: str | None = None,
) -> tuple[torch.dtype, str]:
    """The serving dtype and why, for the banner and the kernel matrix.

    An explicit `--dtype` is taken as given. `auto` on CUDA follows the compute capability
    (`auto_dtype`). `auto` on CPU picks bfloat16 only when both hold: the startup probe measured
    bf16 matmuls at least as fast as float32 (`facts.bf16_speedup >= 1`; AVX512-BF16/AMX CPUs,
    ~4x; on AVX2 bf16 is ~50x slower) and the checkpoint is not float32 (16-bit or quantized
    weights, whose own precision bf16 keeps: vLLM likewise follows the checkpoint's dtype). A
    float32 checkpoint (the tests' tiny models) is served in float32."""
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {requested!r}; choose from {sorted(DTYPE_NAMES)}")
        dtype = DTYPE_NAMES[requested]
        why = f"--dtype {requested}"
        slow = device.type == "cpu" and dtype != torch.float32 and facts is not None
        if slow and 0 < facts.bf16_speedup < 1:  # type: ignore[union-attr]
            why += f"; slow here: bf16 matmul {facts.bf16_speedup:.2g}x float32 at startup"  # type: ignore[union-attr]
        return dtype, why
    if device.type == "cuda":
        capability = facts.capability if facts is not None else None
        dtype = auto_dtype(device, capability)
        if dtype == torch.bfloat16:
            return dtype, "auto: CUDA sm80+ (bf16 tensor cores)"
        return dtype, "auto: CUDA below sm80 has no bf16 tensor cores"
    if facts is None or not facts.bf16_speedup:
        return torch.float32, "auto: CPU bf16 speed not measured"
    speed = f"bf16 matmul {facts.bf16_speedup:.2g}x float32 at startup"
    if facts.bf16_speedup < 1.0:
        return torch.float32, f"auto: {speed} (slower)"
    if checkpoint_dtype is None:
        return torch.float32, f"auto: {speed}, but the checkpoint's dtype is unknown"
    if checkpoint_dtype in ("float32", "float64"):
        return torch.float32, f"auto: the checkpoint is {checkpoint_dtype} ({speed})"
    return torch.bfloat16, f"auto: {speed}, {checkpoint_dtype} checkpoint"


def lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules` entries (NAME=PATH or JSON {"name", "path"}) as name -> path."""
    out: dict[str, str] = {}
    for item in specs:
        if item.lstrip().startswith("{"):
            try:
                entry = json.loads(item)
                name, path = str(entry["name"]), str(entry["path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules entry {item!r}: JSON needs name and path") from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"lora_modules entry {item!r}: expected NAME=PATH")
        if not name or not path or name in out:
            raise ValueError(f"lora_modules entry {item!r}: an empty or repeated name or path")
        out[name] = path
    return out


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with the help text (and the values) `--help` shows for its flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class EngineConfig:
    model: str | None = setting(
        None, "HF checkpoint directory or GGUF file (default: the shipped SmolLM2-135M-Instruct)"
    )
    mmproj: str = setting(
        "",
        "llama.cpp's projector GGUF (convert_hf_to_gguf.py --mmproj) for a GGUF text model's "
        "images; served: projector type gemma3 beside a gemma3 text GGUF; empty: text only",
    )
    dtype: str = setting(
        "auto",
        "serving dtype. auto: CUDA bfloat16 from sm80, float16 below; CPU bfloat16 where it "
        "measures faster at startup and the checkpoint is 16-bit or quantized, else float32",
        ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"),
    )
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    block_size: int | None = setting(
        None, "tokens per KV block, a power of two up to 128 (0: 64 on CPU, 16 on CUDA)"
    )
    num_kv_blocks: int | None = setting(
        None, "KV blocks in the device pool (0: sized from kv_cache_memory or GPU memory)"
    )
    kv_cache_memory: str = setting("2GiB", "KV cache budget on CPU, e.g. 2GiB")
    encoder_cache_bytes: str = setting(
        "64MiB", "a vision model's cache of encoded images (soft tokens by content hash)"
    )
    gpu_memory_utilization: float = setting(
        0.90, "fraction of GPU memory for weights + KV cache on CUDA"
    )
    max_num_seqs: int = setting(64, "most requests in one batch")
    max_num_batched_tokens: int = setting(1024, "token budget of one engine step")
    scheduling: str = setting(
        "deadline",
        "order of prefills: deadline (each request's time-to-first-token deadline, arrival plus "
        "4x its uncached prefill alone: prefix hits and short prompts first, long ones promoted "
        "as they age) or fcfs (arrival order)",
        ("deadline", "fcfs"),
    )
    short_prefill_tokens: int = setting(
        512,
        "a request whose uncached remainder is at most this many tokens (a prefix hit, a new "
        "turn) is short: while one waits, or arrived within ten full steps' time (at most 5 s) "
        "while requests decode, steps are held to target_step_ms; 0: every step held to it",
    )
    target_step_ms: float = setting(
        0.0,
        "latency a step is held to while short prefills are near, prefill chunks cut to fit: 0 "
        "measured at startup (the shortest step whose prefill costs within 5% a token of the "
        "cheapest measured); -1: every step may take max_num_batched_tokens",
    )
    max_itl_factor: float = setting(
        0.0,
        "streamed decode rows' inter-token latency under long prompts, while every pending "
        "prefill still finishes within 2x its prefill alone: 0 (default) a step carrying them "
        "gives prefills at most the chunk measured at startup (the shortest whose prefill "
        "costs within 25% a token of the cheapest); N >= 1: such a step costs at most N times "
        "their decode step alone; -1: unbounded",
    )
    max_model_len: int | None = setting(None, "context length served (0: the model's own)")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks across requests by prefix hash")
    kv_pin_share: float = setting(
        0.25,
        "the most of the KV pool one application may keep pinned (Anthropic cache_control "
        "breakpoints); beyond it its oldest pins lapse into ordinary LRU blocks; 0: no pinning",
    )
    attention_backend: str = setting(
        "auto",
        "attention kernels; auto picks from the kernel-support matrix at startup; torch: the "
        "CPU backend (C++ decode and prefill); reference: gather + SDPA, plain PyTorch on any "
        "device (slow, for checking and for models nothing else serves)",
        ("auto", "flashinfer", "xformers", "torch", "reference"),
    )
    allow_slow_dtype: bool = setting(
        False, "serve bf16/fp16 on a CPU without native support anyway (else refused)"
    )
    require_fast_kernels: bool = setting(False, "refuse to start on a slow general attention path")
    enforce_eager: bool = setting(False, "CUDA: no CUDA graphs for decode steps")
    seed: int = setting(0, "seed of the engine's sampling generator")
    host_bytes: str = setting(
        "0", "host-memory KV tier for evicted and idle sessions' blocks, e.g. 8GiB; 0: off"
    )
    disk_path: str = setting(
        "",
        f"disk KV tier directory under the host tier (of {DEFAULT_HOST_BYTES} if host_bytes "
        "is 0); empty: off",
    )
    disk_bytes: str = setting("20GiB", "disk KV tier size")
    preemption_mode: str = setting(
        "swap",
        "a preempted request's KV: swap (full blocks to the host tier) or recompute",
        ("swap", "recompute"),
    )
    kv_hash_seed: str = setting(
        "",
        "root of the prefix-cache block hashes; every instance sharing a remote KV store sets "
        "the same one. Empty: random per process (or the disk tier's stored root)",
    )
    speculative_model: str = setting(
        "", "EAGLE draft head directory (empty: the head shipped for the default model)"
    )
    num_speculative_tokens: int = setting(
        8, "most draft tokens per request and step (speculative decoding); 0: off"
    )
    speculative_method: str = setting(
        "auto",
        "where drafts come from (engine/spec/drafting.py): suffix (this request's prompt and "
        "output, recent outputs), grammar (tokens a constraint forces), corpus (the model's own "
        "answers to a broad prompt set, tools/answer_corpus.py), eagle (the draft head), auto "
        "(each request's best expected source each step: grammar, suffix, corpus where one "
        "exists for the model, and eagle when --speculative-model names a head), off",
        ("auto", "suffix", "grammar", "corpus", "eagle", "off"),
    )
    speculative_corpus: str = setting(
        "",
        "answer corpus directory for corpus drafts (answers.tokens.npy, answers.suffixes.npy: "
        "tools/answer_corpus.py --out); empty: the one shipped for these weights, if any; "
        "off: none",
    )
    spec_cost_model: bool = setting(
        True,
        "adaptive k by the verify and draft step costs measured at startup (engine/spec/cost.py)"
        ", within spec_max_verify_rows; off: batch x (1 + k) stays within that cap",
    )
    spec_max_verify_rows: int = setting(16, "most verify rows (batch x (1 + k)) in one step")
    reclaim_window_blocks: bool = setting(
        True,
        "sliding-window layers (Gemma 3, Mistral) keep only the window's KV blocks, in a pool of "
        "their own; the rest go back as a request advances",
    )
    cpu_packed_weights: bool = setting(
        True,
        "CPU: also hold oneDNN-packed weight copies where they measure faster at startup "
        "(2x weight memory)",
    )
    quantization: str = setting(
        "auto",
        "weights at load. auto: a GGUF's Q4_0/Q4_1/Q8_0 matrices served as stored (CPU), the "
        "rest in the serving dtype; none: all dequantized; int8: CPU W8A8 dynamic (accuracy "
        "judged at startup); int4 | int8wo: weight-only, rounded to Q4_1 | Q8_0 blocks",
        ("auto", "none", "int8", "int4", "int8wo"),
    )
    gguf_int8_activations: str = setting(
        "off",
        "GGUF block kernel on int8 activations per block of 32 (llama.cpp's numerics). auto: "
        "where it measures faster and the startup accuracy judge accepts it against float "
        "activations; on: where faster, the judge's figures only reported; off: never (the "
        "default: prefill chunks above the kernel's rows still run on float activations, so "
        "a prefix-cache hit could answer differently from a miss)",
        ("auto", "on", "off"),
    )
    gguf_int8_prefill: str = setting(
        "off",
        "GGUF weights' dense path (prefill chunks, wide decode steps) as int8 W8A8: the blocks "
        "rounded again per output channel after SmoothQuant's factor from calibration text, "
        "activations per row, int32 sums (VNNI where the CPU has it). auto: from the rows "
        "where it measures faster, on the projections the startup accuracy judge accepts "
        "against the float GEMM; on: every projection where faster, the judge's figures only "
        "reported; off: never (the default: every step's rows on float activations, so a "
        "near-tie does not flip with a step's row count; 1 byte a weight more memory)",
        ("auto", "on", "off"),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype. auto: the serving dtype; bfloat16: half a float32 model's KV bytes "
        "(CPU); int8: int8 values with a float32 scale per 32 (1.125 bytes a value) under a "
        "float32 or bfloat16 model, served by the torch backend, its agreement with a cache of "
        "the serving dtype measured at startup (banner); fp8 is refused (no kernel reads it)",
        ("auto", "bfloat16", "float32", "fp8", "int8"),
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks that split each layer's heads and FFN (one process each, started by the "
        "server; gloo on CPU, NCCL on CUDA); models whose head count varies by layer get a "
        "plan per layer group",
    )
    tensor_parallel_allreduce: str = setting(
        "auto",
        "how CPU ranks sum layer outputs: auto/shm (shared memory, one host), gloo "
        "(torch.distributed over loopback TCP); CUDA ranks use NCCL",
        ("auto", "shm", "gloo"),
    )
    tensor_parallel_timeout_s: float = setting(
        120.0, "how long tensor-parallel ranks may take to start and meet"
    )
    pooling: str = setting(
        "auto",
        "embeddings pooling; auto: the checkpoint's sentence-transformers config, else last",
        ("auto", "last", "mean"),
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "LoRA adapters served from startup, each NAME=PATH (a PEFT directory or a "
            'GGUF LoRA file) or JSON {"name": ..., "path": ...}; a request picks one by its '
            "model name; more load at run time (POST /v1/load_lora_adapter)",
            "choices": None,
        },
    )
    max_loras: int = setting(
        4, "LoRA adapters whose requests run at once (a step batches their rows); 0: LoRA off"
    )
    max_lora_rank: int = setting(64, "largest rank a LoRA adapter may have")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(
        self, facts: DeviceFacts | None = None, checkpoint_dtype: str | None = None
    ) -> torch.dtype:
        """`choose_dtype`'s dtype; on CPU `auto` without the probe's facts and the checkpoint's
        dtype is float32."""
        return self.dtype_choice(facts, checkpoint_dtype)[0]

    def dtype_choice(
        self, facts: DeviceFacts | None = None, checkpoint_dtype: str | None = None
    ) -> tuple[torch.dtype, str]:
        return choose_dtype(self.dtype, self.resolved_device(), facts, checkpoint_dtype)

    def host_tier_bytes(self) -> int:
        """The host tier's bytes: host_bytes, or DEFAULT_HOST_BYTES under a disk path (which
        alone would otherwise be silently ignored: the disk tier hangs under the host tier)."""
        host_bytes = parse_bytes(self.host_bytes)
        return parse_bytes(DEFAULT_HOST_BYTES) if host_bytes <= 0 and self.disk_path else host_bytes

    def resolved_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 64 if self.resolved_device().type == "cpu" else 16

    def validate(self) -> None:
        for f in fields(self):  # a setting with named values takes one of them
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}")
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two up to 128")
        if self.short_prefill_tokens < 0:
            raise ValueError("short_prefill_tokens must be >= 0 (0: every step held to target)")
        if self.max_itl_factor not in (-1, 0) and self.max_itl_factor < 1:
            raise ValueError(
                "max_itl_factor must be 0 (the measured chunk), -1 (unbounded) or at least 1"
            )
        if self.target_step_ms < 0 and self.target_step_ms != -1:
            raise ValueError("target_step_ms must be -1 (off), 0 (measured) or positive")
        if not 0.0 <= self.kv_pin_share <= 1.0:
            raise ValueError("kv_pin_share must be in [0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        parse_bytes(self.host_bytes)
        parse_bytes(self.disk_bytes)
        if self.num_speculative_tokens < 0 or self.spec_max_verify_rows < 1:
            raise ValueError("num_speculative_tokens must be >= 0, spec_max_verify_rows >= 1")
        if self.gguf_int8_prefill == "on" and self.tensor_parallel_size > 1:
            raise ValueError(
                "gguf_int8_prefill on is a single-rank path (its measurement and judge run on "
                "one model); use auto or off with tensor parallelism"
            )
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout_s <= 0:
            raise ValueError("tensor_parallel_size must be >= 1, tensor_parallel_timeout_s > 0")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        lora_modules(self.lora_modules)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
