"""Seconds to answer one `response_format: json_schema` request (`max_tokens: 2`) per schema, on
the default model through HTTP, in order on a freshly started server: an object of N string
properties (the first request is the server's first constrained one), a 10-level nested object,
and a pathological one (optional properties beside additional ones). `--checkout DIR` serves
from another checkout (e.g. `git worktree add /tmp/old <commit>`) to compare before and after in
one run; each request stops waiting after `--give-up` seconds. `--cold-bitmask-op`: as on a
fresh machine, the grammar bitmask's C++ op is not built yet (the other ops are copied from
the torch extensions cache, so startup does not rebuild them).

    python bench/grammar_compile.py [--checkout DIR] [--required] [--give-up 300]
        [--cold-bitmask-op]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from harness.launch import ROOT, Process, kvserve_cmd

SIZES = (20, 300, 1_000, 3_000, 5_000)


def wide(n: int, required: bool, **extra) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
    if required:
        schema["required"] = list(schema["properties"])
    return schema | extra


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"l{i}": schema, "n": {"type": "integer"}}}
    return schema


def ask(base: str, schema: dict, give_up: float) -> str:
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
        return f"> {give_up:.0f} s (gave up)"
    took = time.monotonic() - start
    return f"{took:.2f} s" + ("" if r.status_code == 200 else f" ({r.status_code})")


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
        for n in SIZES:
            print(f"  {n:>6} properties: {ask(server.base, wide(n, args.required), args.give_up)}")
        print(f"  10-level nested : {ask(server.base, nested(10), args.give_up)}")
        bad = wide(3_000, False, additionalProperties=True)
        print(f"  3,000 optional + additional: {ask(server.base, bad, args.give_up)}")


if __name__ == "__main__":
    main()
