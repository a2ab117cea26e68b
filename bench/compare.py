"""kvserve against peer servers on the same model and workload, interleaved (A B A B) so drift on a
shared machine hits every server alike.

    python tools/export_gguf.py                      # float32 weights for the peers (once)
    bench/setup_peers.sh llama-server vllm      # build / install peers (once; see README)
    python bench/compare.py --out bench/results/compare.json --plot bench/results/compare.png

Every available server is started once and kept up; each experiment then runs on each server in
turn, the order rotated every round. Experiments: output throughput at each concurrency level
(~256-token unique prompts, 128 output tokens, ignore_eos), TTFT at concurrency 1 for each
--ttft-lens prompt length, and the shared-prefix and multi-turn workloads. Prints one table per
figure with kvserve's ratio to the best peer, and kvserve's throughput as a fraction of this
machine's float32 ceiling (bench/roofline.py). Missing peers are listed and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import peers, roofline
from bench import serve as loadgen
from models.loader import default_model_path, load_spec


@dataclass(slots=True)
class Experiment:
    key: str  # e.g. "throughput c=16"
    workload: str
    concurrency: int
    num_requests: int
    input_len: int
    output_len: int
    prefix_words: int = 800  # shared-prefix: ~1,000 shared tokens

    def args(self, base_url: str, model: str, seed: int) -> argparse.Namespace:
        return loadgen.parser().parse_args(
            [
                *("--base-url", base_url, "--model", model, "--workload", self.workload),
                *("--concurrency", str(self.concurrency)),
                *("--num-requests", str(self.num_requests), "--input-len", str(self.input_len)),
                *("--output-len", str(self.output_len), "--ignore-eos", "--seed", str(seed)),
                *("--prefix-words", str(self.prefix_words), "--sessions", "8", "--quiet"),
            ]
        )


def experiments(a: argparse.Namespace) -> list[Experiment]:
    out = [
        Experiment(
            f"throughput c={c}", "fixed", c, max(a.min_requests, c), a.input_len, a.output_len
        )
        for c in a.concurrency
    ]
    out += [Experiment(f"ttft {n}", "fixed", 1, a.ttft_requests, n, 4) for n in a.ttft_lens]
    if a.app_requests:
        n, tokens = a.app_requests, a.app_output_len
        out.append(
            Experiment("shared-prefix c=8", "shared-prefix", 8, n, 32, tokens, a.prefix_words)
        )
        out.append(Experiment("multi-turn c=8", "multi-turn", 8, n, 32, tokens))
    return out


def brief_runs(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, list[dict]]]:
    """experiment -> server -> each round's summary without the per-request detail."""
    return {
        k: {n: [loadgen.brief(s) for s in rs] for n, rs in v.items()} for k, v in results.items()
    }


def save_raw(path: str, results: dict[str, dict[str, list[dict]]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(brief_runs(results), f, indent=2)


def warm_up(proc, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    for _ in range(2):
        httpx.post(proc.base + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


def mean_summary(runs: list[dict]) -> dict:
    """Round means of the headline figures (each round's full summary stays in the JSON)."""

    def avg(path: tuple[str, ...]) -> float:
        values = []
        for r in runs:
            v = r
            for k in path:
                v = v[k]
            values.append(v)
        return statistics.mean(values)

    return {
        "output_throughput": avg(("output_throughput",)),
        "ttft_s": {q: avg(("ttft_s", q)) for q in ("mean", "p50", "p90", "p99")},
        "tpot_s": {q: avg(("tpot_s", q)) for q in ("mean", "p50", "p90", "p99")},
        "prefix_hit_rate": avg(("prefix_hit_rate",)),
        "failed": sum(r["failed"] for r in runs),
        "rounds": [r["output_throughput"] for r in runs],
    }


def table(
    title: str, rows: list[str], names: list[str], value, higher_better: bool, fmt: str
) -> str:
    """Markdown table: one row per experiment, a column per server, then kvserve / best peer
    (and speculation on / off where kvserve also ran without it)."""
    spec_col = peers.SPEC_OFF in names
    head = " | kvserve / best peer |" + (" spec on / off |" if spec_col else "")
    lines = [f"**{title}**", "", "| | " + " | ".join(names) + head]
    lines.append("|---" * (len(names) + 2 + spec_col) + "|")
    for row in rows:
        cells, values = [], {}
        for n in names:
            v = value(row, n)
            values[n] = v
            cells.append("-" if v is None else format(v, fmt))
        ours = values.get("kvserve")
        others = [v for n, v in values.items() if not n.startswith("kvserve") and v]
        best = (max if higher_better else min)(others, default=None)
        cells.append(better_by(ours, best, higher_better))
        if spec_col:
            cells.append(better_by(ours, values.get(peers.SPEC_OFF), higher_better))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def better_by(ours: float | None, theirs: float | None, higher_better: bool) -> str:
    """How many times better ours is (a ratio above 1 is better either way), or "-"."""
    if not ours or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x" if higher_better else f"{theirs / ours:.2f}x"


def variant(text: str) -> tuple[str, list[str]]:
    """`--variant NAME=FLAGS` as (NAME, the flags split as a shell would)."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME=FLAGS")
    return name, shlex.split(flags)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers-dir", default="bench/.peers")
    ap.add_argument("--only", default="", help="comma list of servers (default: all available)")
    ap.add_argument("--model", default=None, help="the GGUF (default: SmolLM2)")
    ap.add_argument("--concurrency", type=loadgen.levels, default=[1, 4, 16, 64])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=4, help="per level: max(this, c)")
    ap.add_argument("--ttft-lens", type=loadgen.levels, default=[256, 1500])
    ap.add_argument("--ttft-requests", type=int, default=3)
    ap.add_argument(
        "--app-requests", type=int, default=32, help="shared-prefix / multi-turn (0: skip)"
    )
    ap.add_argument("--app-output-len", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=800, help="shared-prefix workload")
    ap.add_argument(
        "--precision",
        choices=sorted(peers.PRECISIONS),
        default="default",
        help="default: the shipped GGUF as each server serves it (llama.cpp: that Q4_1 file); "
        "bf16; float32; int8 (Q8_0)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--spec-off",
        action="store_true",
        help="also kvserve with --num-speculative-tokens 0 (on/off from the same rounds)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also kvserve with these flags, as kvserve-NAME in the same rounds (never a peer), "
        "e.g. int8='--gguf-int8-prefill auto'",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default="bench/results/compare.json")
    ap.add_argument("--plot", default="bench/results/compare.png")
    a = ap.parse_args(argv)

    gguf = a.model or default_model_path()
    # llama-server splits its context evenly over its slots: each must hold the longest prompt
    ctx_per_slot = max(512, max(a.ttft_lens) + a.output_len + 128)
    found = peers.catalog(
        Path(a.peers_dir),
        gguf,
        a.threads,
        max(a.concurrency),
        ctx_per_slot,
        a.precision,
        a.spec_off,
        dict(variant(v) for v in a.variant),
    )
    chosen = [p for p in found.available if not a.only or p.name in a.only.split(",")]
    for name, why in found.missing.items():
        print(f"skipping {name}: {why}")
    spec = load_spec(gguf)
    gflops = roofline.matmul_gflops(spec.hidden_size, spec.layers[0].intermediate_size, 256)
    gbps = roofline.read_gbps()
    print(f"machine: float32 matmul {gflops:.0f} GFLOP/s, memory read {gbps:.1f} GB/s")
    print(f"CPU flags (for the record; nothing is chosen by them): {cpu_flags()}")

    procs = {}
    try:
        for peer in chosen:
            t = time.monotonic()
            proc = peers.start(peer)
            model = proc.model_id()
            procs[peer.name] = (proc, peer, model)
            warm_up(proc, model)
            print(f"started {peer.name} in {time.monotonic() - t:.0f} s (model id {model!r})")
            if peer.name == "kvserve":
                verdict = [ln for ln in proc.log().splitlines() if "dtype" in ln or "weights" in ln]
                print("kvserve: " + " | ".join(v.strip() for v in verdict[:3]))
        names = list(procs)
        results: dict[str, dict[str, list[dict]]] = {}
        for exp in experiments(a):
            for rnd in range(a.rounds):
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for name in order:
                    proc, peer, model = procs[name]
                    if exp.concurrency > peer.max_concurrency:
                        continue
                    # same prompts for every server within a round; fresh ones for each round
                    # and experiment, so no server meets a prompt it has cached before
                    seed = zlib.crc32(exp.key.encode()) + 1000 * rnd
                    args = exp.args(proc.base, model, seed)
                    summary = asyncio.run(loadgen.run(args))
                    results.setdefault(exp.key, {}).setdefault(name, []).append(summary)
                    if a.out:  # raw results so far, in case a later step fails
                        save_raw(a.out, results)
                    print(
                        f"{exp.key:20s} round {rnd} {name:20s} "
                        f"{summary['output_throughput']:7.1f} tok/s  "
                        f"TTFT p50 {summary['ttft_s']['p50']:.2f} s  "
                        f"failed {summary['failed']}",
                        flush=True,
                    )
    finally:
        for proc, _, _ in procs.values():
            proc.stop()

    # a server that failed any request of an experiment gets no figure for it (a partial run's
    # throughput or latency would mislead); its errors stay in the JSON
    means = {
        k: {n: mean_summary(runs) for n, runs in v.items() if not any(r["failed"] for r in runs)}
        for k, v in results.items()
    }
    ceilings = {
        c: roofline.workload_ceiling(spec, gflops, gbps, c, a.input_len + 14, a.output_len)
        for c in a.concurrency
    }
    report = render(a, names, means, ceilings, gflops, gbps)
    print(report)
    doc = {
        "schema_version": loadgen.SCHEMA_VERSION,
        "config": vars(a),
        "servers": names,
        "machine": {"gflops": gflops, "read_gbps": gbps},
        "ceilings": ceilings,
        "skipped": found.missing,
        "means": means,
        "runs": brief_runs(results),
        "report": report,
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    if a.plot:
        from bench.plot import plot_levels

        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        series = {
            n: [
                (c, means[f"throughput c={c}"][n])
                for c in a.concurrency
                if n in means.get(f"throughput c={c}", {})
            ]
            for n in names
        }
        plot_levels(
            series,
            a.plot,
            f"{Path(gguf).stem}, {a.input_len}-token prompts, {a.output_len} output tokens",
            ceiling=sorted(ceilings.items()),
        )
    return doc


def cpu_flags() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "unknown"
    shown = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    return " ".join(f for f in shown if f in flags) or "none of " + " ".join(shown)


def render(a, names, means, ceilings, gflops, gbps) -> str:
    def get(row: str, name: str, *path: str) -> float | None:
        v = means.get(row, {}).get(name)
        for k in path:
            if v is None:
                return None
            v = v[k]
        return v

    tp_rows = [f"throughput c={c}" for c in a.concurrency]
    ttft_rows = [f"ttft {n}" for n in a.ttft_lens]
    app_rows = [r for r in ("shared-prefix c=8", "multi-turn c=8") if r in means]
    parts = [
        table(
            "Output tokens/s (mean of rounds)",
            tp_rows + app_rows,
            names,
            lambda r, n: get(r, n, "output_throughput"),
            True,
            ".1f",
        ),
        table(
            "TTFT p50 (s)",
            ttft_rows + tp_rows + app_rows,
            names,
            lambda r, n: get(r, n, "ttft_s", "p50"),
            False,
            ".3f",
        ),
        table(
            "TPOT p50 (ms)",
            tp_rows + app_rows,
            names,
            lambda r, n: None if get(r, n) is None else 1000 * get(r, n, "tpot_s", "p50"),
            False,
            ".1f",
        ),
        table(
            "Prefix hit rate (cached / prompt tokens, from usage)",
            app_rows,
            names,
            lambda r, n: get(r, n, "prefix_hit_rate"),
            True,
            ".2f",
        ),
    ]
    roof = [
        f"float32 ceiling (matmul {gflops:.0f} GFLOP/s, read {gbps:.1f} GB/s; one wave of c "
        "requests, prefill included):",
        "",
        "| c | ceiling tok/s | kvserve tok/s | fraction |",
        "|---|---|---|---|",
    ]
    for c, ceiling in sorted(ceilings.items()):
        ours = get(f"throughput c={c}", "kvserve", "output_throughput")
        frac = f"{ours / ceiling:.0%}" if ours else "-"
        roof.append(f"| {c} | {ceiling:.1f} | {ours or 0:.1f} | {frac} |")
    return "\n\n".join(parts + ["\n".join(roof)])


if __name__ == "__main__":
    main()
