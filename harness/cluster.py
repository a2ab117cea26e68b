"""Multi-process serving on loopback, for the tests and benchmarks: a Redis/Valkey KV store and
vllm-router in front of kvserve workers (replicas, or a prefill and a decode instance). Every
process is started here, on a free 127.0.0.1 port, and stopped by its PID (`stop()`, or the
context manager)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import redis

from harness.launch import Process

ROUTER_BIN = Path(sys.executable).with_name("vllm-router")
# the router binds its port only once a worker of each kind is healthy, re-checking every
# `--worker-startup-check-interval` (30 s by default); afterwards a worker failing one check
# (1 s apart) stops getting traffic
FAST_HEALTH = [
    "--worker-startup-check-interval",
    "1",
    "--worker-startup-timeout-secs",
    "120",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--health-check-timeout-secs",
    "1",
]


def redis_server_bin() -> str | None:
    """Debian's redis-server (or Valkey's, which speaks the same protocol)."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


class KVStoreProcess(Process):
    """An in-memory Redis: no persistence, LRU within `maxmemory`; `.url` is its redis:// URL.
    `port`: bind that one (a restart on the port the instances know; `log_name` keeps the
    first one's log apart), else a free one."""

    def __init__(
        self,
        maxmemory: str = "2gb",
        timeout: float = 20.0,
        port: int | None = None,
        log_name: str | None = None,
    ) -> None:
        binary = redis_server_bin()
        if binary is None:
            raise RuntimeError("no redis-server (apt-get install redis-server)")
        super().__init__(
            "kvstore",
            lambda port: [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            timeout=timeout,
            stop_timeout=5.0,
            port=port,
            log_name=log_name,
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server not ready after {timeout}s:\n{self.log()}")

    def num_keys(self) -> int:
        return int(redis.Redis.from_url(self.url).dbsize())


class RouterProcess(Process):
    """vllm-router on loopback: `RouterProcess(["--worker-urls", URL, ...])` for replicas, or
    `RouterProcess.pd(prefill_url, decode_url)` for prefill/decode disaggregation."""

    def __init__(self, args: list[str], timeout: float = 60.0) -> None:
        self.metrics_port = 0

        def cmd(port: int) -> list[str]:
            from harness.launch import free_port

            self.metrics_port = free_port()
            return [
                str(ROUTER_BIN),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(self.metrics_port),
                *args,
            ]

        super().__init__("router", cmd, health_path="/health", timeout=timeout, stop_timeout=5.0)

    @classmethod
    def pd(cls, prefill_urls: list[str], decode_url: str) -> RouterProcess:
        """PD mode (its default `nixl` connector passes `kv_transfer_params` through opaquely).
        round_robin: cache_aware would fan /tokenize and /render out to every worker on every
        request. The router never retries in PD mode: a dead prefill worker costs 500s until
        its health check drops it, hence checks every second."""
        prefills = [a for url in prefill_urls for a in ("--prefill", url)]
        return cls(
            [
                "--vllm-pd-disaggregation",
                *prefills,
                "--decode",
                decode_url,
                "--policy",
                "round_robin",
                *FAST_HEALTH,
            ]
        )

    @classmethod
    def replicas(cls, urls: list[str], policy: str = "consistent_hash") -> RouterProcess:
        """consistent_hash keys on the X-Session-ID (else X-User-ID) header; vllm-router
        0.1.17 ignores the body's `user` on chat."""
        return cls(["--worker-urls", *urls, "--policy", policy, *FAST_HEALTH])
