"""Every x86 CPU (issue #27): the AVX2-only machine's paths, reproduced on whatever CPU runs the
suite by restricting the instruction sets the libraries may use (`RESTRICTED_ISA`):
`ONEDNN_MAX_CPU_ISA=AVX2` makes oneDNN refuse packed bf16 weights exactly as a Zen 3 does
("bf16 path needs the cpu support avx_ne_convert or avx512bw ..."), `ATEN_CPU_CAPABILITY=avx2`
takes ATen's AVX2 kernels, `FBGEMM_ENABLE_INSTRUCTIONS=AVX2` fbgemm's int8 kernels without VNNI.
On an AVX2-only CPU the restriction changes nothing, so these tests mean the same there.

Each test runs the restricted code in a child process: the variables are read once, when the
libraries load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from openai import OpenAI

from tests.server_utils import ROOT, kvserve_server

pytestmark = pytest.mark.slow  # child processes under restricted ISAs

RESTRICTED_ISA = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
}


# the restriction plus Zen 3's measured bf16 speed (tests/data/zen3_bf16/sitecustomize.py)
ZEN3_BF16 = {**RESTRICTED_ISA, "PYTHONPATH": f"{ROOT / 'tests/data/zen3_bf16'}:{ROOT}"}


def run_restricted(code: str) -> dict:
    """Run `code` (which prints one JSON line last) in a child under RESTRICTED_ISA."""
    env = {**os.environ, **RESTRICTED_ISA, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restricted_onednn_refuses_packed_bf16_and_linear_takes_the_plain_path() -> None:
    got = run_restricted(
        """
import json, torch
import torch.nn.functional as F
from models.linear.dense import onednn_pack_refusal
from models.linear.layer import Linear
lin = Linear(96, 160).to(torch.bfloat16)
lin.weight.data.normal_()
added = lin.pack()
x = torch.randn(5, 96, dtype=torch.bfloat16)
with torch.inference_mode():
    same = torch.equal(lin(x), F.linear(x, lin.weight))
print(json.dumps({"bf16": onednn_pack_refusal(torch.bfloat16),
                  "f32": onednn_pack_refusal(torch.float32), "added": added, "same": same}))
"""
    )
    assert got["bf16"] and "bf16 path needs the cpu support" in got["bf16"]
    assert got["f32"] is None  # float32 packing works on every x86 CPU
    assert got["added"] == 0 and got["same"]


def test_slow_bf16_refuses_in_one_line_without_a_traceback(llama_dir) -> None:
    """`--dtype bfloat16` where bf16 is slow (the startup probe measures it) exits non-zero with
    one fatal line naming the dtype requirement and how to serve anyway."""
    s = kvserve_server(llama_dir, env=ZEN3_BF16, wait=False, dtype="bfloat16")
    code = s.proc.wait(timeout=180)
    log = s.log()
    s.stop()
    assert code != 0
    assert "Traceback" not in log, log[-3000:]
    fatal = [line for line in log.splitlines() if "fatal:" in line]
    assert len(fatal) == 1, log[-3000:]
    assert "dtype: bfloat16 on a CPU without native bf16" in fatal[0]
    assert "--allow-slow-dtype" in fatal[0]


def test_slow_bf16_serves_when_allowed_and_says_why(llama_dir) -> None:
    with kvserve_server(
        llama_dir, env=ZEN3_BF16, dtype="bfloat16", allow_slow_dtype=True, num_kv_blocks=64
    ) as s:
        client = OpenAI(base_url=s.base + "/v1", api_key="x")
        r = client.completions.create(model="", prompt="hello there", max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens > 0
        log = s.log()
    assert "Traceback" not in log
    assert "unpacked: oneDNN refuses packed bfloat16 here" in log
    assert "slow here: bf16 matmul" in log  # the banner's dtype line says how slow
