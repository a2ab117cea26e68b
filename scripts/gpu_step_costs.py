"""The CPU-side cost of each device-check step (scripts/gpu_check.sh), measured here: what a step
spends before and beside the GPU (imports, checkpoint builds, engine builds), which its bound
adds the expected GPU time to. Run on the machine you have; the note beside the bounds says
which figures came from where.

    .venv/bin/python scripts/gpu_step_costs.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(label: str, fn) -> float:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(f"{label:<58} {seconds:6.1f} s", flush=True)
    return seconds


def main() -> int:
    from tests.conftest import HEAD64_GQA2, build_model

    tmp = Path(tempfile.mkdtemp(prefix="gpu_step_costs_"))
    model = tmp / "model"
    python = [sys.executable]
    timed(
        "import server.app (a fresh interpreter)",
        lambda: subprocess.run([*python, "-c", "import server.app"], check=True, cwd=ROOT),
    )
    timed("model: the head-64 GQA-2 checkpoint", lambda: build_model("llama", model, **HEAD64_GQA2))
    timed(
        "kernels: `server kernels` on the CPU (imports, load, matrix)",
        lambda: subprocess.run(
            [*python, "-m", "server", "kernels", "--model", str(model), "--device", "cpu"],
            check=True,
            cwd=ROOT,
            capture_output=True,
        ),
    )

    from engine import LLM

    build = timed(
        "one engine build on the CPU (load, plan, warm-up)",
        lambda: LLM(str(model), num_kv_blocks=64, device="cpu"),
    )
    source = (ROOT / "tests" / "test_gpu.py").read_text()
    engines = len(re.findall(r"\bLLM\(", source))
    print(f"{'  engine builds in tests/test_gpu.py':<58} {engines:6d}")
    print(f"{'  their CPU side at that rate':<58} {engines * build:6.1f} s")

    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_sweep import smollm2_shaped

    timed(
        "sweep: the SmolLM2-shaped random checkpoint", lambda: smollm2_shaped(str(tmp / "smollm2"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
