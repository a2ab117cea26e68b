"""Coding-agent CLIs as clients, run headless as their users run them: Codex CLI (`codex exec`,
from npm, installed by scripts/setup.sh into .agents/) over `/v1/responses` with a provider entry
in its own CODEX_HOME. Codex's first request carries ~30,000 tokens of instructions and tool
schemas in the tests' tiny tokenizer (reasoning settings, `include`, `namespace` and hosted tools
among them), so the tiny model is served with a 32k context; on SmolLM2's 2k-8k the CLI shows
the server's 400 with both numbers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SMOL, build_model
from tests.server_utils import kvserve_server

pytestmark = pytest.mark.slow  # servers and a CLI

ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / ".agents" / "node_modules" / ".bin" / "codex"


def codex(base: str, model: str, prompt: str, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "kvserve"\n\n[model_providers.kvserve]\n'
        f'name = "kvserve"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        'env_key = "KVSERVE_KEY"\n'
    )
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CODEX_HOME": str(home), "KVSERVE_KEY": "unused"}
    return subprocess.run(
        [str(CODEX), "exec", "--skip-git-repo-check", prompt],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def codex_bin() -> Path:
    if not CODEX.exists():
        pytest.fail("Codex CLI not installed: run ./scripts/setup.sh --test (needs npm)")
    return CODEX


def test_codex_exec_gets_an_answer(codex_bin, tmp_path) -> None:
    model = build_model("llama", tmp_path / "tiny", max_position_embeddings=32768)
    with kvserve_server(
        model, served_model_name="kv-model", max_model_len=32768, num_kv_blocks=1024
    ) as server:
        done = codex(server.base, "kv-model", "Say hello.", tmp_path / "home", tmp_path / "w")
        log = server.log()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "tokens used" in done.stdout + done.stderr
    assert '"POST /v1/responses HTTP/1.1" 200' in log and " 400 " not in log


def test_codex_shows_the_context_limit_of_a_small_model(codex_bin, smol_tools_server, tmp_path):
    done = codex(smol_tools_server.base, SMOL, "Say hello.", tmp_path / "home", tmp_path / "w")
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "maximum context length is 2048 tokens" in said, said[-2000:]
