"""The kernel-support matrix: what each attention backend can serve, checked per requirement
against the model's geometry and the device's facts, before the server takes traffic.

Device facts are a value (`DeviceFacts`), detected once and injectable, so the selection rules for
sm80/sm90 GPUs are tested on a CPU-only machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from models.spec import ModelSpec

REQUIREMENTS = (
    "device",
    "warm-up",
    "compute capability",
    "dtype",
    "head_dim",
    "GQA group size",
    "block size",
    "per-layer heads",
    "KV sharing",
    "sliding window",
    "mixed windows",
    "soft-capping",
    "tree masks",
    "int8 KV",
    "compressed attention",
    "sparse attention",
    "image spans",
)


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    type: str  # "cpu" or "cuda"
    name: str = ""
    capability: tuple[int, int] | None = None  # CUDA (major, minor)
    native_bf16: bool = False  # CPU: AVX512-BF16 or AMX; CUDA: sm80+
    libraries: frozenset[str] = frozenset()  # importable GPU kernel libraries
    # library -> why its kernels cannot be had here although it imports (e.g. FlashInfer is
    # JIT-only and there is no nvcc nor a matching prebuilt kernel package)
    kernel_notes: dict[str, str] = field(default_factory=dict)
    # CPU: float32 time / bfloat16 time of a batched matmul, measured at startup (`bf16_probe`);
    # >= 1 means bf16 is at least as fast, and `--dtype auto` may pick it. 0: not measured.
    bf16_speedup: float = 0.0

    @staticmethod
    def detect(device: torch.device) -> DeviceFacts:
        libs = frozenset(lib for lib in ("flashinfer", "xformers") if _importable(lib))
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            name = torch.cuda.get_device_name(device)
            notes = {lib: why for lib in libs if (why := kernel_note(lib))}
            return DeviceFacts("cuda", name, cap, cap >= (8, 0), libs, notes)
        speedup = bf16_probe()
        return DeviceFacts("cpu", "cpu", None, speedup >= 0.5, libs, bf16_speedup=speedup)

    @property
    def label(self) -> str:
        if self.capability:
            return f"{self.name} (sm{self.capability[0]}{self.capability[1]})"
        if self.type == "cpu" and self.bf16_speedup:
            native = "native bf16, " if self.native_bf16 else ""
            return f"cpu ({native}bf16 matmul {self.bf16_speedup:.2g}x float32)"
        return f"{self.type}{' (native bf16)' if self.native_bf16 else ''}"


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def find_nvcc() -> str | None:
    """nvcc as FlashInfer's JIT looks for it: $CUDA_HOME/bin/nvcc, else on PATH."""
    import os
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.isfile("/usr/local/cuda/bin/nvcc") else None
    )


def kernel_note(lib: str) -> str | None:
    """Why `lib` imports but cannot run its kernels here, or None. Package metadata and the
    file system only (no import: importing flashinfer takes seconds). The warm-up proves the
    rest by running them."""
    if lib == "xformers":
        if not _importable("triton"):
            return "the paged decode operator (triton_splitk) needs triton, which is not installed"
        return None
    if lib != "flashinfer":
        return None
    version = _version("flashinfer-python")
    jit_cache = _version("flashinfer-jit-cache")
    if jit_cache is not None and version and jit_cache.split("+")[0] == version:
        return None  # kernels prebuilt ahead of time
    if find_nvcc() is not None:  # JIT: compiled at first use into its cache directory
        return jit_cache_note()
    return (
        f"flashinfer-python {version} ships no kernels (JIT-only) and there is neither nvcc "
        f"(CUDA_HOME unset, none on PATH) nor flashinfer-jit-cache=={version}"
    )


def jit_cache_note() -> str | None:
    """Why FlashInfer's JIT cannot write its kernels here, or None: the directory it compiles
    into (FLASHINFER_WORKSPACE_BASE, else the home directory; then .cache/flashinfer) must be
    writable, or creatable, by this user. A root-owned bind-mounted /cache in a non-root
    container is a startup reason, not a compile failure in the warm-up."""
    import os

    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    target = os.path.join(base, ".cache", "flashinfer")
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK):
        return None
    return (
        f"FlashInfer compiles its kernels into {target}, which user {os.getuid()} cannot "
        f"write ({existing} is not a writable directory): a volume mounted there must be "
        "writable by the server's user, or set FLASHINFER_WORKSPACE_BASE elsewhere"
    )


# The probe's layer: 64 rows (a batched decode step or a prefill chunk) through a hidden x
# 3*hidden linear layer at SmolLM2's hidden size 576, the batched work where the dtype matters.
PROBE_ROWS, PROBE_IN, PROBE_OUT = 64, 576, 1728


@functools.cache
def bf16_probe() -> float:
    """float32 time / bfloat16 time of a PROBE_ROWS x PROBE_IN @ PROBE_IN x PROBE_OUT matmul here
    (> 1: bf16 is faster). Measured, not read from CPU flags: an advertised avx512_bf16 does not
    guarantee torch uses it, and where it does not, bf16 runs tens of times slower than float32
    (Zen 3: ~1 GFLOP/s, ~70 ms a call; Zen 5: ~4x float32). The two dtypes alternate and each
    keeps its best of 5 (other processes share the cores); a warm bf16 call slower than 10
    float32 calls ends it early. Once per process, ~10 ms on a fast CPU."""
    import time

    import torch.nn.functional as F

    x, w = torch.randn(PROBE_ROWS, PROBE_IN), torch.randn(PROBE_OUT, PROBE_IN)
    args = {dt: (x.to(dt), w.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    best = {dt: float("inf") for dt in args}

    def once(dt: torch.dtype) -> float:
        start = time.perf_counter()
        F.linear(*args[dt])
        best[dt] = min(best[dt], time.perf_counter() - start)
        return best[dt]

    with torch.inference_mode():
        once(torch.float32)  # warm-up (oneDNN/MKL kernel selection)
        once(torch.float32)
        # bf16's first call builds its kernel (it measured 36x float32 once on a Zen 5 that
        # runs bf16 4x faster, and `auto` served float32): judge the second
        once(torch.bfloat16)
        if once(torch.bfloat16) > 10 * best[torch.float32]:
            return best[torch.float32] / best[torch.bfloat16]
        for _ in range(5):
            once(torch.float32)
            once(torch.bfloat16)
    return best[torch.float32] / best[torch.bfloat16]


@dataclass(frozen=True, slots=True)
class ModelNeeds:
    """What a model asks of an attention kernel, derived from its `ModelSpec`."""

    head_dims: tuple[int, ...]
    group_sizes: tuple[int, ...]
    uneven_gqa: bool
    per_layer_heads: bool
    kv_sharing: bool
    sliding_window: int | None
    mixed_windows: bool  # windowed layers and full-context layers in one model (Gemma 3)
    soft_cap: float | None
    tree_masks: bool
    int8_kv: bool  # --kv-cache-dtype int8: rows with their scales (engine/attention/kv_quant.py)
    # DeepSeek V4: compressed entries (one per m tokens) attended beside a window (HCA, and CSA
    # too), and the lightning indexer's top-k selection of them with a sparse gather (CSA)
    compressed: bool = False
    sparse: bool = False
    # an image's soft tokens attend to each other both ways inside a causal prompt (Gemma 3)
    image_spans: bool = False

    @staticmethod
    def of(spec: ModelSpec, tree_masks: bool = False, int8_kv: bool = False) -> ModelNeeds:
        return ModelNeeds(
            tuple(sorted({lay.head_dim for lay in spec.layers})),
            tuple(sorted({lay.num_heads // max(1, lay.num_kv_heads) for lay in spec.layers})),
            any(lay.num_heads % max(1, lay.num_kv_heads) for lay in spec.layers),
            spec.has_per_layer_heads,
            spec.has_kv_sharing,
            spec.sliding_window,
            spec.has_mixed_windows,
            spec.extra.get("attn_logit_softcapping"),
            tree_masks,
            int8_kv,
            any(g.role in ("csa", "hca") for g in spec.group_specs),
            any(g.role == "csa" for g in spec.group_specs),
            spec.vision is not None and spec.vision.two_way,  # Qwen's images stay causal
        )


Verdict = dict[str, str | None]  # requirement -> reason it fails, or None when met


def _gpu_library(facts: DeviceFacts, library: str) -> Verdict:
    """The "device" verdict of a backend built on a GPU kernel library: a CUDA device, the
    library installed, and nothing known to stop its kernels from building or loading."""
    if facts.type != "cuda":
        return {"device": "needs a CUDA GPU"}
    if library not in facts.libraries:
        return {"device": f"{library} is not installed (pip install .[gpu])"}
    if facts.kernel_notes.get(library):
        return {"device": facts.kernel_notes[library]}
    return {}


def gpu_verdict(
    facts: DeviceFacts,
    library: str,
    min_capability: tuple[int, int],
    dtype: torch.dtype,
    capability_why: str = "",
    dtype_why: str = "kernels are built for float16/bfloat16",
) -> Verdict:
    """The verdicts a backend built on a CUDA kernel library shares with the others: the device
    (`_gpu_library`), a compute capability of at least `min_capability` (`capability_why`: what
    sets it) and a float16/bfloat16 serving dtype (`dtype_why`: why)."""
    verdict = _gpu_library(facts, library)
    cap = facts.capability
    if cap is not None and cap < min_capability:
        need = f"sm{min_capability[0]}{min_capability[1]}"
        verdict["compute capability"] = f"sm{cap[0]}{cap[1]} < {need}{capability_why}"
    if dtype not in (torch.float16, torch.bfloat16):
        verdict["dtype"] = f"{dtype_name(dtype)}: {dtype_why}"
    return verdict


def slow_cpu_dtype(facts: DeviceFacts, dtype: torch.dtype) -> Verdict:
    """The "dtype" verdict of a backend computing in the serving dtype on this CPU: bf16/fp16
    without native support is refused (waivable: --allow-slow-dtype)."""
    if facts.type != "cpu" or dtype == torch.float32 or facts.native_bf16:
        return {}
    speed = (
        f"measured {facts.bf16_speedup:.2g}x float32's matmul speed at startup"
        if facts.bf16_speedup
        else "tens of times slower than float32"
    )
    return {
        "dtype": f"{dtype_name(dtype)} on a CPU without native bf16/fp16: {speed} "
        "(use --dtype float32, or --allow-slow-dtype to serve it anyway)"
    }


# A model's need (a `ModelNeeds` flag) -> the matrix row and reason where a backend's kernels
# lack it (`model_refusals`; sparse attention rides on compressed-attention support)
_UNSUPPORTED = {
    "sliding_window": ("sliding window", "no paged local-attention mask in its kernels"),
    "mixed_windows": ("mixed windows", "one window per step's plan, not one per layer"),
    "soft_cap": ("soft-capping", "logit soft-capping is not supported"),
    "tree_masks": ("tree masks", "custom (tree) masks are not supported"),
    "int8_kv": ("int8 KV", "its kernels read float16/bfloat16 pages, not int8 rows with scales"),
    "compressed": (
        "compressed attention",
        "no kernel here reads compressed KV groups (one entry per m tokens beside the window, "
        "with a sink per head); the torch backend's PyTorch path serves DeepSeek V4",
    ),
    "sparse": (
        "sparse attention",
        "no lightning-indexer top-k over compressed entries nor a sparse gather in its "
        "kernels (FlashMLA-style sparse decode is not wired here)",
    ),
    "image_spans": ("image spans", "no mask for an image's bidirectional span in a causal prompt"),
}


def model_refusals(
    needs: ModelNeeds,
    *,
    head_dims: tuple[int, ...] | None = None,
    sliding_window: bool = True,
    mixed_windows: bool = True,
    soft_cap: bool = True,
    tree_masks: bool = False,
    int8_kv: bool = False,
    compressed: bool = False,
    image_spans: bool = False,
) -> Verdict:
    """The model-shape requirements a backend cannot serve, in the matrix's one wording: each
    backend says what its kernels support (`head_dims`: the head sizes they are built for,
    None for any) and gets its rows' reasons."""
    verdict: Verdict = {}
    bad_dims = [d for d in needs.head_dims if head_dims is not None and d not in head_dims]
    if bad_dims:
        verdict["head_dim"] = f"head_dim {bad_dims} not in {head_dims}"
    if needs.uneven_gqa:
        verdict["GQA group size"] = "query heads not a multiple of KV heads"
    supports = {
        "sliding_window": sliding_window,
        "mixed_windows": mixed_windows,
        "soft_cap": soft_cap,
        "tree_masks": tree_masks,
        "int8_kv": int8_kv,
        "compressed": compressed,
        "sparse": compressed,
        "image_spans": image_spans,
    }
    for need, (row, why) in _UNSUPPORTED.items():
        if getattr(needs, need) and not supports[need]:
            verdict[row] = why
    return verdict


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def format_matrix(verdicts: dict[str, Verdict], chosen: str, why: str) -> str:
    """Backend x requirement table ('ok' or the reason), the choice and why."""
    names = list(verdicts)
    width = max(len(r) for r in REQUIREMENTS) + 2
    col = max(12, *(len(n) + 2 for n in names))
    lines = [" " * width + "".join(n.ljust(col) for n in names)]
    notes: list[str] = []
    for req in REQUIREMENTS:
        cells = []
        for name in names:
            reason = verdicts[name].get(req)
            if reason is None:
                cells.append("ok".ljust(col))
            else:
                notes.append(f"  [{len(notes) + 1}] {name} / {req}: {reason}")
                cells.append(f"no [{len(notes)}]".ljust(col))
        lines.append(req.ljust(width) + "".join(cells))
    lines.extend(notes)
    lines.append(f"  -> {chosen}: {why}")
    return "\n".join(lines)
