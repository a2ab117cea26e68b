"""Faults survived, with figures (#66): streaming chat clients through vllm-router in front of a
prefill and a decode instance sharing a Redis KV store (values authenticated with a shared
kv_store_key), while the store is SIGKILLed at 1/3 of the run and restarted on the same port at
1/2, and a hostile body arrives every `--hostile-every` seconds, sent through the router and
straight to the decode instance. Printed per phase (store up / down / back, by the moment a
request was sent): streams completed and failed (by HTTP status; 200+error = an error event in
the stream, 0 = transport error or timeout), hostile bodies by status, every 5xx, and the
instances' remote-store counters (blocks published, tokens fetched, misses, fallback reasons,
refused values), so one sees the hand-over stop and resume. Exit code 1 on any 5xx or a request
that never ended. Every process is started here on loopback and stopped by its PID.

    python bench/chaos.py [--duration 60] [--streams 4] [--hostile-every 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from bench.disagg import text_of
from harness.cluster import KVStoreProcess, RouterProcess
from harness.launch import Process, kvserve_cmd
from harness.sse import stream

PHASES = ("store up", "store down", "store back")
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}


def j(**extra) -> bytes:
    return json.dumps({**CHAT, **extra}).encode()


SURROGATE = json.dumps(CHAT).replace("hi there", "hi \\ud83d").encode()
HOSTILE: list[tuple[str, str, bytes]] = [  # (what, path, raw body)
    ("grammar root ::= root", "chat", j(structured_outputs={"grammar": "root ::= root"})),
    (
        "grammar: only the end, min_tokens 3",
        "chat",
        j(structured_outputs={"grammar": 'root ::= ""'}, min_tokens=3),
    ),
    ("logit_bias out of range", "chat", j(logit_bias={"5": 1e6})),
    ("logit_bias unknown token", "chat", j(logit_bias={"999999999": 1.0})),
    ("bad types", "chat", json.dumps({"messages": "hi", "max_tokens": "ten"}).encode()),
    ("huge max_tokens", "chat", j(max_tokens=10**15)),
    ("invalid JSON", "chat", b'{"messages": [{"role": "user", "content": "hi"'),
    ("lone surrogate", "chat", SURROGATE),
    ("lone surrogate, streamed", "chat", SURROGATE[:-1] + b', "stream": true}'),
    ("deep nesting", "chat", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("NaN temperature", "chat", j()[:-1] + b', "temperature": NaN}'),
    ("n = 10000", "chat", j(n=10_000)),
    ("empty body", "chat", b""),
    ("not UTF-8", "chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    (
        "out-of-vocab ids, echo",
        "completions",
        json.dumps({"prompt": [[10**9]], "echo": True, "max_tokens": 2}).encode(),
    ),
    ("5 MB prompt", "completions", json.dumps({"prompt": "x " * 2_500_000}).encode()),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DECODE_METRICS = {
    "fetches": "kvserve:kv_transfer_received_tokens_count",
    "tokens fetched": "kvserve:kv_transfer_received_tokens_sum",
    "store misses (blocks)": "kvserve:kv_transfer_store_misses_total",
    "remote values refused": 'kvserve:kv_tier_integrity_failures_total{tier="remote"}',
}
PREFILL_METRICS = {
    "blocks published": "kvserve:kv_transfer_published_blocks_total",
    "publish failures": "kvserve:kv_transfer_publish_failures_total",
}


def instance(name: str, cores: str, args: list[str], key: str) -> Process:
    """kvserve pinned to `cores`, one thread (as bench/disagg.py), the store key in its env."""
    cmd = kvserve_cmd(args)
    env = {"OMP_NUM_THREADS": "1", "KVSERVE_KV_STORE_KEY": key}
    return Process(
        name,
        lambda port: ["taskset", "-c", cores, *cmd(port)],
        env,
        timeout=300,
        stop_timeout=20,
        wait=False,
    )


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    text = (await client.get(base + "/metrics", timeout=10)).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(kvserve:\S+) (\S+)$", text, re.M)}


class Run:
    def __init__(self, args: argparse.Namespace, router: str, decode: str, prefill: str):
        self.args, self.router, self.decode, self.prefill = args, router, decode, prefill
        self.t0 = time.monotonic()
        self.bounds = [args.duration / 3, args.duration / 2]
        self.streams: dict[str, Counter] = defaultdict(Counter)
        self.hostile: dict[str, Counter] = defaultdict(Counter)
        self.by_body: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        self.five: list[str] = []  # every 5xx / hang, described
        self.snaps: list[tuple[dict, dict]] = []
        self.restart_s = 0.0

    def phase(self) -> str:
        t = time.monotonic() - self.t0
        return PHASES[sum(t >= b for b in self.bounds)]

    async def streamer(self, client: httpx.AsyncClient, i: int) -> None:
        rng, k = random.Random(i), 0
        while time.monotonic() - self.t0 < self.args.duration:
            phase, k = self.phase(), k + 1
            prompt = f"{i}.{k} " + text_of(rng, 40)
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": self.args.tokens,
                "ignore_eos": True,
            }
            s = await stream(client, "/v1/chat/completions", body)
            label = "ok" if s.ok else ("200+error" if s.status == 200 else str(s.status))
            self.streams[phase][label] += 1
            if s.ok and (s.usage or {}).get("completion_tokens") != self.args.tokens:
                self.streams[phase]["short answer"] += 1
            if not s.ok and (s.status >= 500 or s.status == 0):
                self.five.append(f"{phase}: stream {i}.{k}: {s.status} {s.error[:160]}")

    async def hostile_one(self, client: httpx.AsyncClient, n: int) -> None:
        what, path, raw = HOSTILE[n % len(HOSTILE)]
        phase = self.phase()
        for target, base in (("router", self.router), ("decode", self.decode)):
            try:
                r = await client.post(
                    base + PATHS[path],
                    content=raw,
                    timeout=30,
                    headers={"Content-Type": "application/json"},
                )
                label = str(r.status_code)
                if r.status_code == 200 and '"error"' in r.text:
                    label = "200+error"
                if r.status_code >= 500:
                    self.five.append(
                        f"{phase}: hostile {what!r} via {target}: {r.status_code} {r.text[:160]}"
                    )
            except httpx.HTTPError as e:
                label = "0"
                self.five.append(f"{phase}: hostile {what!r} via {target}: {e!r}")
            self.hostile[f"{phase}|{target}"][label] += 1
            self.by_body[what][target].add(label)

    async def snap(self, client: httpx.AsyncClient) -> None:
        self.snaps.append((await scrape(client, self.decode), await scrape(client, self.prefill)))

    async def main(self, store: list[KVStoreProcess]) -> None:
        a = self.args
        async with httpx.AsyncClient(base_url=self.router, timeout=a.request_timeout) as client:
            await self.snap(client)
            self.t0 = time.monotonic()
            tasks = [asyncio.create_task(self.streamer(client, i)) for i in range(a.streams)]

            async def hostile() -> None:
                n = 0
                while time.monotonic() - self.t0 < a.duration:
                    tasks.append(asyncio.create_task(self.hostile_one(client, n)))
                    n += 1
                    await asyncio.sleep(a.hostile_every)

            async def chaos() -> None:
                await asyncio.sleep(self.bounds[0])
                await self.snap(client)
                print(f"{time.monotonic() - self.t0:5.1f}s SIGKILL store pid {store[0].proc.pid}")
                store[0].proc.kill()
                store[0].stop()
                await asyncio.sleep(self.bounds[1] - (time.monotonic() - self.t0))
                t, port = time.monotonic(), store[0].port
                again = {"port": port, "log_name": "kvserve-bench-kvstore2", "maxmemory": "1gb"}
                store.append(await asyncio.to_thread(lambda: KVStoreProcess(**again)))
                self.restart_s = time.monotonic() - t
                print(
                    f"{time.monotonic() - self.t0:5.1f}s store back on port {port} (pid "
                    f"{store[-1].proc.pid}, {self.restart_s:.2f}s)",
                    flush=True,
                )
                await self.snap(client)

            await asyncio.gather(hostile(), chaos())
            try:  # the streams finish their last request: bounded, a hang is reported
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=a.request_timeout + 30)
            except TimeoutError:
                self.five.append("requests still running past --request-timeout (a hang)")
            await self.snap(client)

    def report(self) -> dict:
        def deltas(which: int, name: str) -> list[float]:
            s = self.snaps
            return [s[i + 1][which].get(name, 0) - s[i][which].get(name, 0) for i in range(3)]

        fallbacks = sorted({k for d, _ in self.snaps for k in d if "_fallbacks_total" in k})
        rows: dict[str, list] = {
            "streams ok": [self.streams[p]["ok"] for p in PHASES],
            "streams failed (by status)": [
                {k: v for k, v in self.streams[p].items() if k != "ok"} or "-" for p in PHASES
            ],
            "hostile via router (by status)": [dict(self.hostile[f"{p}|router"]) for p in PHASES],
            "hostile to decode (by status)": [dict(self.hostile[f"{p}|decode"]) for p in PHASES],
        }
        for label, name in DECODE_METRICS.items():
            rows[f"decode: {label}"] = deltas(0, name)
        for name in fallbacks:
            rows["decode: fallback " + re.sub(r'.*reason="(\w+)".*', r"\1", name)] = deltas(0, name)
        for label, name in PREFILL_METRICS.items():
            rows[f"prefill: {label}"] = deltas(1, name)
        cell = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
        cells = {k: [cell(v) for v in vs] for k, vs in rows.items()}
        first = max(len(k) for k in rows) + 2
        cols = [max(len(p), *(len(c[i]) for c in cells.values())) + 2 for i, p in enumerate(PHASES)]
        for name, values in [("", list(PHASES)), *cells.items()]:
            print(name.ljust(first) + "".join(v.ljust(w) for v, w in zip(values, cols)))
        print("each hostile body, statuses via the router | straight to the decode instance:")
        for what, got in self.by_body.items():
            statuses = [",".join(sorted(got[t])) for t in ("router", "decode")]
            print(f"  {what:<38}" + " | ".join(statuses))
        print(f"store restart took {self.restart_s:.2f}s; 5xx / hangs: {len(self.five)}")
        for line in self.five:
            print("  " + line)
        bodies = {w: {t: sorted(v) for t, v in got.items()} for w, got in self.by_body.items()}
        return {"phases": list(PHASES), "rows": rows, "hostile": bodies, "five_xx": self.five}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per streamed answer")
    ap.add_argument("--hostile-every", type=float, default=2.0, help="seconds between bodies")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    common = ["--max-model-len", "2048", "--max-num-seqs", "32", "--kv-hash-seed", "bench-chaos"]
    key = f"chaos-{random.randrange(1 << 62):x}"
    procs: list[Process] = []
    stores: list[KVStoreProcess] = []
    try:
        stores.append(KVStoreProcess(maxmemory="1gb"))
        at = ["--kv-store-url", stores[0].url]
        prefill = [*common, "--role", "prefill", "--max-num-batched-tokens", "256", *at]
        procs.append(instance("prefill", "0", prefill, key))
        procs.append(instance("decode", "1", [*common, "--role", "decode", *at], key))
        for p in procs:
            p.wait_ready(300)
        p, d = procs
        procs.append(RouterProcess.pd([p.base], d.base))
        print(
            f"store pid {stores[0].proc.pid}, prefill pid {p.proc.pid}, decode pid "
            f"{d.proc.pid}, router pid {procs[-1].proc.pid}; logs in {Path(p.log_path).parent}",
            flush=True,
        )
        run = Run(args, procs[-1].base, d.base, p.base)
        asyncio.run(run.main(stores))
        out = run.report()
        for proc in procs:
            if proc.proc.poll() is not None:
                out["five_xx"].append(f"{proc.name} exited {proc.proc.returncode}")
                print(f"{proc.name} exited {proc.proc.returncode} ({proc.log_path})")
    finally:
        for proc in reversed(procs + stores):
            proc.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=2))
    return 1 if out["five_xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
