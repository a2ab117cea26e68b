"""Clients that stop reading, and idle open streams, against a plain request's latency, on the
default model through HTTP, side by side in one run:

- idle: a plain chat request's latency (median of 5) alone;
- 200 idle streams: the same with 200 streamed requests answered and left open, unread;
- stalled readers: 8 streamed requests of 400 tokens whose clients never read (the server's
  socket buffers fill), timed until the engine has finished them, with the server's RSS growth
  and the plain request's latency meanwhile.

    python bench/slow_clients.py [--streams 200] [--stalled 8] [--tokens 400]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import httpx

from harness.launch import Process, kvserve_cmd


def body(max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Say something about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def latency(base: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.monotonic()
        httpx.post(base + "/v1/chat/completions", json=body(8), timeout=60).raise_for_status()
        times.append(time.monotonic() - start)
    return statistics.median(times)


def unread_stream(port: int, max_tokens: int) -> socket.socket:
    raw = json.dumps(body(max_tokens, stream=True)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def running(base: str) -> int:
    stats = httpx.get(base + "/v1/stats", timeout=10).json()
    return stats["running"] + stats["waiting"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--stalled", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    cmd = kvserve_cmd(["--served-model-name", "m", "--dtype", "float32"])
    with Process("slow-clients", cmd, timeout=300) as server:
        base = server.base
        latency(base, 2)  # warm
        idle = latency(base)
        print(f"plain request alone: {idle * 1000:.0f} ms")
        socks = [unread_stream(server.port, 1) for _ in range(args.streams)]
        while running(base):
            time.sleep(0.1)
        with_idle = latency(base)
        print(
            f"with {args.streams} idle open streams: {with_idle * 1000:.0f} ms "
            f"({with_idle / idle:.2f}x alone)"
        )
        for s in socks:
            s.close()
        before = rss_mib(server.proc.pid)
        start = time.monotonic()
        stalled = [unread_stream(server.port, args.tokens) for _ in range(args.stalled)]
        during = latency(base, 3)
        while running(base):
            time.sleep(0.1)
        took = time.monotonic() - start
        print(
            f"{args.stalled} unread streams of {args.tokens} tokens: finished in the engine "
            f"after {took:.1f} s (no reader); RSS {before:.0f} -> {rss_mib(server.proc.pid):.0f} "
            f"MiB; a plain request meanwhile {during * 1000:.0f} ms (batched with them)"
        )
        for s in stalled:
            s.close()


if __name__ == "__main__":
    main()
