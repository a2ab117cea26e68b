"""The servers `bench/compare.py` measures kvserve against, and how each is started.

Peers live under a peers directory (default `bench/.peers`, git-ignored), put there by
`bench/setup_peers.sh`; a peer that is not there is skipped with the reason, never faked:

    models/               weights for all (tools/export_gguf.py): *.{F32,BF16,Q8_0}.gguf and hf/
    llama.cpp/build/bin/llama-server      llama.cpp's C++ server (continuous batching, -np slots)
    vllm-venv/bin/python                  vLLM's CPU build, in its own venv
    llama-cpp-python-venv/bin/python      llama-cpp-python[server] (one request at a time)

The naive transformers baseline (`bench/naive_server.py`) needs nothing beyond the test extras.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.launch import ROOT, Process, kvserve_cmd

Cmd = Callable[[int], list[str]]
SPEC_OFF = "kvserve-spec-off"  # kvserve itself with speculation off: never a peer


@dataclass(slots=True)
class Peer:
    name: str
    make_cmd: Cmd
    env: dict[str, str] = field(default_factory=dict)
    max_concurrency: int = 1 << 30  # a serialised server is not driven past this
    startup_s: float = 180.0


@dataclass(slots=True)
class Catalog:
    available: list[Peer]
    missing: dict[str, str]  # name -> why it is skipped


# what each server runs at each precision of a comparison: "default" is what a user would get
# on this machine from the shipped file (kvserve's defaults, which serve its Q4_1 blocks as
# stored; llama.cpp on that very file, gguf None; vLLM's CPU build, which cannot read it, on a
# bf16 checkpoint); "bf16" pairs kvserve's bf16 with llama.cpp's BF16 GGUF; "int8" kvserve's
# int8 weights with llama.cpp's Q8_0
PRECISIONS = {
    "default": {"kvserve": [], "gguf": None, "vllm": "bfloat16"},
    "bf16": {
        "kvserve": ["--dtype", "bfloat16", "--quantization", "none"],
        "gguf": "BF16",
        "vllm": "bfloat16",
    },
    "float32": {
        "kvserve": ["--dtype", "float32", "--quantization", "none"],
        "gguf": "F32",
        "vllm": "float32",
    },
    "int8": {"kvserve": ["--quantization", "int8"], "gguf": "Q8_0", "vllm": None},
}


def catalog(
    peers_dir: Path,
    gguf: str,
    threads: int,
    slots: int,
    ctx_per_slot: int,
    precision: str = "float32",
    spec_off: bool = False,
    variants: dict[str, list[str]] | None = None,
) -> Catalog:
    models = peers_dir / "models"
    how = PRECISIONS[precision]
    llama_gguf = (
        Path(gguf) if how["gguf"] is None else models / f"{Path(gguf).stem}.{how['gguf']}.gguf"
    )
    hf = models / "hf"
    available: list[Peer] = [Peer("kvserve", kvserve_cmd(["--model", gguf, *how["kvserve"]]))]
    if spec_off:  # the same server without speculation: its on/off ratio from the same rounds
        off = ["--model", gguf, *how["kvserve"], "--num-speculative-tokens", "0"]
        available.append(Peer(SPEC_OFF, kvserve_cmd(off)))
    for name, flags in (variants or {}).items():  # kvserve under other flags: never a peer
        available.append(
            Peer(f"kvserve-{name}", kvserve_cmd(["--model", gguf, *how["kvserve"], *flags]))
        )
    missing: dict[str, str] = {}

    def need(name: str, *paths: Path) -> bool:
        absent = [str(p) for p in paths if not p.exists()]
        if absent:
            missing[name] = f"not set up ({', '.join(absent)} missing; bench/setup_peers.sh)"
        return not absent

    server = peers_dir / "llama.cpp" / "build" / "bin" / "llama-server"
    if need("llama-server", server, llama_gguf):
        available.append(
            Peer(
                "llama-server",
                lambda port: (
                    [str(server), "-m", str(llama_gguf), "-t", str(threads)]
                    + ["-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-webui"]
                    + ["--host", "127.0.0.1", "--port", str(port)]
                ),
            )
        )
    vllm = peers_dir / "vllm-venv" / "bin" / "python"
    vllm_dtype = how["vllm"]
    if vllm_dtype is None:
        missing["vllm-cpu"] = f"no {precision} checkpoint for vLLM's CPU build here"
    elif need("vllm-cpu", vllm, hf):
        available.append(
            Peer(
                "vllm-cpu",
                # the API server module directly: the `vllm` CLI asks for the version of a
                # distribution named "vllm", and this one is "vllm-cpu"
                lambda port: (
                    [str(vllm), "-m", "vllm.entrypoints.openai.api_server"]
                    + ["--model", str(hf), "--dtype", str(vllm_dtype)]
                    + ["--served-model-name", "smollm2", "--max-model-len", "4096"]
                    + ["--max-num-seqs", str(slots), "--host", "127.0.0.1", "--port", str(port)]
                ),
                env={
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "VLLM_HOST_IP": "127.0.0.1",
                    "VLLM_CPU_KVCACHE_SPACE": "4",
                    "VLLM_NO_USAGE_STATS": "1",
                    "HF_HUB_OFFLINE": "1",
                },
                startup_s=600.0,
            )
        )
    if precision != "float32":  # the serialised baselines are float32 references only
        return Catalog(available, missing)
    lcp = peers_dir / "llama-cpp-python-venv" / "bin" / "python"
    if need("llama-cpp-python", lcp):
        available.append(
            Peer(
                "llama-cpp-python",
                # its own quantized GGUF, as users run it (the anchor is Q4_1, serialised)
                lambda port: (
                    [str(lcp), "-m", "llama_cpp.server", "--model", gguf]
                    + ["--n_threads", str(threads), "--n_ctx", "4096", "--chat_format", "chatml"]
                    + ["--host", "127.0.0.1", "--port", str(port)]
                ),
                max_concurrency=4,
            )
        )
    if need("naive-transformers", hf):
        available.append(
            Peer(
                "naive-transformers",
                lambda port: (
                    [sys.executable, str(ROOT / "bench" / "naive_server.py")]
                    + ["--model", str(hf), "--port", str(port)]
                ),
                max_concurrency=4,
            )
        )
    return Catalog(available, missing)


def start(peer: Peer) -> Process:
    return Process(peer.name, peer.make_cmd, env=peer.env, timeout=peer.startup_s)
