"""Coding-agent CLIs as clients, run headless as their users run them, both from npm (installed
by scripts/setup.sh into .agents/): Codex CLI (`codex exec`) over `/v1/responses` with a provider
entry in its own CODEX_HOME, and Claude Code (`claude -p`) over `/v1/messages` with
ANTHROPIC_BASE_URL. Codex's first request carries ~30,000 tokens of instructions and tool schemas
in the tests' tiny tokenizer (reasoning settings, `include`, `namespace` and hosted tools among
them), Claude Code's ~39,000 (system turns, adaptive thinking, output_config, cache_control), so
the tiny model is served with a long context; on SmolLM2's 2k-8k each CLI shows the server's 400
with both numbers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SMOL, build_model
from tests.scripted_model import silence_layers
from tests.server_utils import kvserve_server

pytestmark = pytest.mark.slow  # servers and a CLI

ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / ".agents" / "node_modules" / ".bin" / "codex"
# the native binary of Claude Code's platform package (its wrapper's install script is skipped)
CLAUDE = next(
    iter(
        sorted(
            (ROOT / ".agents" / "node_modules" / "@anthropic-ai").glob("claude-code-linux-*/claude")
        )
    ),
    None,
)


def run_headless(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """A CLI run once without a terminal, in `cwd` (made if missing): its output captured, no
    stdin to wait on."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def codex(base: str, model: str, prompt: str, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "kvserve"\n\n[model_providers.kvserve]\n'
        f'name = "kvserve"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        'env_key = "KVSERVE_KEY"\n'
    )
    env = {**os.environ, "CODEX_HOME": str(home), "KVSERVE_KEY": "unused"}
    return run_headless([str(CODEX), "exec", "--skip-git-repo-check", prompt], cwd, env, 300)


@pytest.fixture(scope="module")
def codex_bin() -> Path:
    if not CODEX.exists():
        pytest.fail("Codex CLI not installed: run ./scripts/setup.sh --test (needs npm)")
    return CODEX


def run_against(
    model: Path, context: int, cli, tmp_path: Path
) -> tuple[subprocess.CompletedProcess, str]:
    """A CLI's one prompt against `model` served with `context` tokens; its result and the
    server's log."""
    blocks = context // 64 + 64  # the CPU's 64-token blocks: one full context and some
    with kvserve_server(
        model, served_model_name="kv-model", max_model_len=context, num_kv_blocks=blocks
    ) as server:
        done = cli(server.base, "kv-model", "Say hello.", tmp_path / "home", tmp_path / "w")
        return done, server.log()


def test_codex_exec_gets_an_answer(codex_bin, tmp_path) -> None:
    # a model that ends its answer in a few tokens: a random one sampled at Codex's temperature
    # can run out of the context's last ~2,700 tokens without an end token
    done, log = run_against(terse_model(tmp_path / "tiny", 32768), 32768, codex, tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "tokens used" in done.stdout + done.stderr
    assert '"POST /v1/responses HTTP/1.1" 200' in log and " 400 " not in log


def test_codex_shows_the_context_limit_of_a_small_model(codex_bin, smol_tools_server, tmp_path):
    done = codex(smol_tools_server.base, SMOL, "Say hello.", tmp_path / "home", tmp_path / "w")
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "maximum context length is 2048 tokens" in said, said[-2000:]


def claude(
    base: str, model: str, prompt: str, home: Path, cwd: Path
) -> subprocess.CompletedProcess:
    """`claude -p` as a user of a self-hosted model runs it: the base URL and a token, every
    model alias pointed at the served name, no traffic beyond the server."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_AUTH_TOKEN": "x",
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    assert CLAUDE is not None
    return run_headless([str(CLAUDE), "-p", prompt, "--model", model], cwd, env, 600)


@pytest.fixture(scope="module")
def claude_bin() -> Path:
    if CLAUDE is None:
        pytest.fail("Claude Code not installed: run ./scripts/setup.sh --test (needs npm)")
    return CLAUDE


def terse_model(out: Path, context: int) -> Path:
    """The tests' tiny Llama, made to end its answers after a few tokens (a random model never
    samples its end token within Claude Code's cap, and the CLI takes a capped answer for an
    error): its layers add nothing to the residual stream, every token's embedding carries one
    large component, and only the end token's head row reads it, for P(end) ~ 1/4 a token."""
    import torch
    import transformers

    path = build_model("llama", out, max_position_embeddings=context)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    eos = model.config.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 8.0
        silence_layers(model)
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos].zero_()
        model.lm_head.weight[eos, 0] = 0.66 / float(model.model.norm.weight[0])
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    return path


def test_claude_code_gets_an_answer(claude_bin, tmp_path) -> None:
    done, log = run_against(terse_model(tmp_path / "tiny", 65536), 65536, claude, tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip()  # the model's few tokens, as the CLI prints an answer
    assert '"POST /v1/messages?beta=true HTTP/1.1" 200' in log and " 400 " not in log


def test_claude_code_shows_the_context_limit_of_a_small_model(
    claude_bin, smol_tools_server, tmp_path
) -> None:
    done = claude(smol_tools_server.base, SMOL, "Say hello.", tmp_path / "home", tmp_path / "w")
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "maximum context length is 2048 tokens" in said, said[-2000:]
