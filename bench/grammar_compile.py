"""Seconds to answer one `response_format: json_schema` request (`max_tokens: 2`) per schema, on
the default model through HTTP, in order on a freshly started server: first ten new objects of
20 string properties (the first request is the server's first constrained one, which the
startup's grammar warm-up is for: its time is printed beside the median of the nine after it;
tests/test_grammar_budget.py counts what it would pay rather than timing it), then an object of
N string properties, a 10-level nested object, and a pathological one (optional properties
beside additional ones). `--checkout DIR` serves from another checkout (e.g. `git worktree add
/tmp/old <commit>`) to compare before and after in one run; each request stops waiting after
`--give-up` seconds. `--cold-bitmask-op`: as on a fresh machine, the grammar bitmask's C++ op
is not built yet (the other ops are copied from the torch extensions cache, so startup does
not rebuild them).

    python bench/grammar_compile.py [--checkout DIR] [--required] [--give-up 300]
        [--cold-bitmask-op]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from harness.launch import ROOT, Process, kvserve_cmd

SIZES = (20, 300, 1_000, 3_000, 5_000)


def wide(n: int, required: bool, tag: str = "p", **extra) -> dict:
    schema = {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}
    if required:
        schema["required"] = list(schema["properties"])
    return schema | extra


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"l{i}": schema, "n": {"type": "integer"}}}
    return schema


def seconds(base: str, schema: dict, give_up: float) -> tuple[float | None, int]:
    """(seconds to the answer, or None when it gave up; the HTTP status)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
    }
    start = time.monotonic()
    try:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=give_up)
    except httpx.TimeoutException:
        return None, 0
    return time.monotonic() - start, r.status_code


def ask(base: str, schema: dict, give_up: float) -> str:
    took, status = seconds(base, schema, give_up)
    if took is None:
        return f"> {give_up:.0f} s (gave up)"
    return f"{took:.2f} s" + ("" if status == 200 else f" ({status})")


def first_and_the_nine_after(base: str, required: bool, give_up: float) -> str:
    """The server's first constrained request against the median of the nine after it, each
    schema new (each compiles): the first pays whatever the startup's warm-up left undone."""
    times = [seconds(base, wide(20, required, tag=f"f{i}_"), give_up)[0] for i in range(10)]
    done = [t for t in times if t is not None]
    if len(done) < len(times):
        return f"gave up after {give_up:.0f} s: {times}"
    return f"first {done[0]:.2f} s, median of the next nine {statistics.median(done[1:]):.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, default=ROOT)
    ap.add_argument("--required", action="store_true", help="every property required")
    ap.add_argument("--give-up", type=float, default=300.0)
    ap.add_argument("--cold-bitmask-op", action="store_true")
    args = ap.parse_args()
    cmd = kvserve_cmd(["--served-model-name", "m", "--dtype", "float32"])
    env = {}
    if args.cold_bitmask_op:
        built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"))
        scratch = Path(tempfile.mkdtemp(prefix="kvserve-ops-"))
        for d in built.expanduser().iterdir():
            if not d.name.startswith("kvserve_token_bitmask"):
                shutil.copytree(d, scratch / d.name)
        env["TORCH_EXTENSIONS_DIR"] = str(scratch)
    with Process("grammar", cmd, env, cwd=args.checkout, timeout=300) as server:
        kind = "required" if args.required else "optional"
        print(f"checkout {args.checkout}: seconds to answer, {kind} string properties")
        first = first_and_the_nine_after(server.base, args.required, args.give_up)
        print(f"  20 properties x 10: {first}")
        for n in SIZES:
            print(f"  {n:>6} properties: {ask(server.base, wide(n, args.required), args.give_up)}")
        print(f"  10-level nested : {ask(server.base, nested(10), args.give_up)}")
        bad = wide(3_000, False, additionalProperties=True)
        print(f"  3,000 optional + additional: {ask(server.base, bad, args.give_up)}")


if __name__ == "__main__":
    main()
