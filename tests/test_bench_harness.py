"""The load generator against a live tiny-model server: a short run completes with sane
figures and a stable JSON shape."""

from __future__ import annotations

import asyncio

import pytest

from bench.serve import SCHEMA_VERSION, parser, run
from tests.server_utils import ServerProcess


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerProcess(["--model", str(llama_dir), "--num-kv-blocks", "128", "--block-size", "16"])
    yield s
    s.stop()


@pytest.mark.parametrize("workload", ["random", "shared-prefix", "multi-turn"])
def test_short_run(server, workload) -> None:
    args = parser().parse_args(
        [
            "--base-url",
            server.base,
            "--workload",
            workload,
            "--concurrency",
            "4",
            "--num-requests",
            "12",
            "--input-len",
            "20:60",
            "--output-len",
            "8",
            "--ignore-eos",
            "--prefix-words",
            "60",
            "--sessions",
            "3",
            "--quiet",
        ]
    )
    summary = asyncio.run(run(args))
    assert summary["schema_version"] == SCHEMA_VERSION
    assert set(summary) >= {
        "requests",
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "prefix_hit_rate",
        "ttft_s",
        "itl_s",
        "tpot_s",
        "e2e_s",
        "config",
        "per_request",
    }
    assert summary["completed"] == 12 and summary["failed"] == 0, [
        r["error"] for r in summary["per_request"][:2]
    ]
    assert summary["completion_tokens"] == 12 * 8
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p99"]
    assert summary["output_throughput"] > 0
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    if workload != "random":
        assert summary["prefix_hit_rate"] > 0.3  # shared prefixes / growing histories hit


def test_poisson_rate(server) -> None:
    args = parser().parse_args(
        [
            "--base-url",
            server.base,
            "--request-rate",
            "20",
            "--num-requests",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--ignore-eos",
            "--quiet",
        ]
    )
    summary = asyncio.run(run(args))
    assert summary["completed"] == 8
