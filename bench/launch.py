"""Start a server process for a benchmark (kvserve or a peer) and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """`make_cmd(port)` -> argv; ready when GET `health_path` answers 200."""

    def __init__(
        self,
        name: str,
        make_cmd,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        timeout: float = 180.0,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/kvserve-bench-{name}-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            make_cmd(self.port),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited; see {self.log.name}")
            try:
                if httpx.get(self.base + health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{name} did not become ready; see {self.log.name}")

    def model_id(self) -> str:
        """The first model the server lists (peers name their model differently)."""
        return httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kvserve_cmd(args: list[str]) -> Callable[[int], list[str]]:
    """argv for kvserve itself on a given port: `python -m server ARGS`."""
    return lambda port: [
        *(sys.executable, "-m", "server", "--port", str(port), "--log-level", "warning"),
        *args,
    ]


class Server(Process):
    """kvserve itself."""

    def __init__(self, args: list[str], timeout: float = 180.0) -> None:
        super().__init__("kvserve", kvserve_cmd(args), timeout=timeout)
