"""scripts/gpu_check.sh's carries (#34): FlashInfer's wheel is larger than one device call may
carry beside the tree, so it travels in two parts that even out two calls, each under the
device's 64 MiB with the tree, and the second call rebuilds the wheel only when its checksum
holds. (`scripts/gpu_check.sh --rehearse` runs both calls end to end on a CPU.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20


def tree_bytes() -> int:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum(
        os.path.getsize(ROOT / f.decode()) for f in files if f and (ROOT / f.decode()).is_file()
    )


def test_the_wheels_travel_in_two_calls_under_the_limit(tmp_path) -> None:
    wheels = tmp_path / "gpu_wheels"
    wheels.mkdir()
    flashinfer = wheels / "flashinfer_python-0.7.2.post1-py3-none-any.whl"
    flashinfer.write_bytes(os.urandom(1 << 20) * 62)  # FlashInfer's 62 MB
    (wheels / "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl").write_bytes(b"x" * 3_300_000)
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"g" * 120_000)
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--split"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "GPU_WHEELS": str(wheels)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    call1, call2 = wheels / "call1", wheels / "call2"
    sizes = [sum(f.stat().st_size for f in d.iterdir()) + tree_bytes() for d in (call1, call2)]
    assert all(s <= LIMIT for s in sizes) and abs(sizes[0] - sizes[1]) < 8 * 2**20, sizes
    assert {f.name for f in call1.iterdir()} >= {"flashinfer.sha256", f"{flashinfer.name}.part00"}
    # the second call's rebuild: the parts in order, checked against the first call's checksum
    kept = tmp_path / "kept"
    kept.mkdir()
    for f in [*call1.glob("*.part*"), call1 / "flashinfer.sha256", *call2.glob("*.part*")]:
        (kept / f.name).write_bytes(f.read_bytes())
    parts = sorted(kept.glob("*.part*"))
    (kept / flashinfer.name).write_bytes(b"".join(p.read_bytes() for p in parts))
    check = ["sha256sum", "-c", "flashinfer.sha256"]
    assert subprocess.run(check, cwd=kept, capture_output=True).returncode == 0
    (kept / flashinfer.name).write_bytes(b"".join(p.read_bytes() for p in parts[::-1]))
    assert subprocess.run(check, cwd=kept, capture_output=True).returncode != 0
