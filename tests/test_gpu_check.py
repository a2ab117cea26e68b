"""scripts/gpu_check.sh, the device check in one call (#50): its steps in order, each under its
own bound, within the call's budget; what the device receives (the tree and one archive of
the packages the host lacks, FlashInfer trimmed) under the device's 64 MiB; and a rehearsal of
the call on this CPU, where the GPU steps report "not run", never "passed". (`--check-trim`
scans FlashInfer's JIT sources against the real trimmed archive; it needs the download and two
minutes, so it is run by hand, not here.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "facts",
    "unpack",
    "model",
    "kernels",
    "torch",
    "flashinfer-compile",
    "flashinfer",
    "graphs",
    "http",
    "sweep",
]


def gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_the_plan_bounds_every_step_within_eight_minutes() -> None:
    run = gpu_check("--plan")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [re.match(r"(\S+)\s+(\d+) s\s+(GPU)?\s*(.*)", line) for line in run.stdout.splitlines()]
    steps = [(m[1], int(m[2]), m[3] == "GPU", m[4]) for m in rows if m and m[1] != "total"]
    assert [s[0] for s in steps] == STEPS
    assert all(bound > 0 for _, bound, _, _ in steps)
    assert sum(bound for _, bound, _, _ in steps) <= 480
    assert "total" in run.stdout.splitlines()[-1]
    by_name = {name: (gpu, cmd) for name, _, gpu, cmd in steps}
    assert "--model $MODEL" in by_name["kernels"][1]  # a real model directory, not the default
    # the JIT compile has a step of its own, before the tests that use its kernels
    assert STEPS.index("flashinfer-compile") < STEPS.index("flashinfer")
    assert not any(by_name[s][0] for s in ("facts", "unpack", "model"))


def test_a_spent_budget_runs_nothing_and_fails(tmp_path) -> None:
    run = gpu_check("--run", GPU_CHECK_BUDGET_S="4", GPU_CHECK_REHEARSAL="1", OUT=str(tmp_path))
    table = (tmp_path / "gpu_check.tsv").read_text().splitlines()[1:]
    results = dict(line.split("\t")[::3] for line in table)
    assert list(results) == STEPS
    assert run.returncode != 0
    assert not any(r == "passed" for r in results.values()), results
    assert results["facts"] == "not run: budget spent"


@pytest.mark.slow
def test_the_rehearsal_carries_under_the_limit_and_runs_the_host_steps(tmp_path) -> None:
    """A rehearsal over a small archive (the real one is built from PyPI by --fetch): the
    carry is reported and under 64 MiB, the steps that need no GPU pass (the archive unpacked,
    the server importable, the model directory built), and every GPU step says "not run"."""
    wheels = tmp_path / "gpu_wheels"
    (tmp_path / "site" / "probe").mkdir(parents=True)
    (tmp_path / "site" / "probe" / "__init__.py").write_text("")
    wheels.mkdir()
    with tarfile.open(wheels / "site.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "site", arcname=".")
    tsv = tmp_path / "steps.tsv"
    run = gpu_check("--rehearse", GPU_WHEELS=str(wheels), REHEARSAL_TSV=str(tsv))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    carried = re.search(r"the call carries (\d+) MiB", run.stdout)
    assert carried is not None and int(carried[1]) <= 64, run.stdout
    results = dict(line.split("\t")[::3] for line in tsv.read_text().splitlines()[1:])
    assert list(results) == STEPS
    assert {results[s] for s in ("facts", "unpack", "model")} == {"passed"}, results
    assert {results[s] for s in STEPS[3:]} == {"not run: no GPU"}, results


def test_the_rehearsal_imports_only_what_the_gpu_host_has() -> None:
    """The rehearsal's fence (scripts/gpu_host/sitecustomize.py): a package of this venv that
    the host's image lacks and the call does not carry (redis) is absent, to `import` and to
    `find_spec` alike, while the server and the engine import. `import server.app` died on the
    host at the unpack step while the server imported redis with its remote store (#65)."""
    carried = re.search(
        r"^PACKAGES=\((.*?)\)", (ROOT / "scripts" / "gpu_check.sh").read_text(), re.S | re.M
    )
    assert carried is not None
    names = " ".join(re.findall(r'"([A-Za-z0-9_.-]+)==', carried[1]))
    assert "xgrammar" in names and "starlette" in names
    probe = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('redis') is None\n"
        "try:\n    import redis\nexcept ModuleNotFoundError: pass\n"
        "else:\n    raise SystemExit('redis importable behind the fence')\n"
        "import server.app, engine.kv.remote\n"
        "from engine import LLM\n"
        "print('fenced ok')\n"
    )
    env = {
        **os.environ,
        "KVSERVE_HOST_PACKAGES": str(ROOT / "scripts/gpu_host/packages.txt"),
        "KVSERVE_CARRIED_PACKAGES": names,
        "PYTHONPATH": str(ROOT / "scripts" / "gpu_host"),
    }
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "fenced ok" in run.stdout, run.stderr[-3000:]
