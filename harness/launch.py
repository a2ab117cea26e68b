"""Start a server process (kvserve or a peer) on a free loopback port, wait until it answers, and
stop it: the one launcher the benchmarks, the tests and scripts/screenshot.py share."""

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
Cmd = Callable[[int], list[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """`make_cmd(port)` -> argv, run from the repository root with stdout and stderr in
    `$TMPDIR/<log_name>-<port>.log` (default log name `kvserve-bench-<name>`); ready when GET
    `health_path` answers 200 (`port`: that one, e.g. to restart where clients point, instead of
    a free one). `wait=False` returns at once (then call `wait_ready`). A context
    manager; `stop()` terminates (kills after `stop_timeout` s) and returns the exit code."""

    def __init__(
        self,
        name: str,
        make_cmd: Cmd,
        env: dict[str, str] | None = None,
        *,
        health_path: str = "/health",
        timeout: float = 180.0,
        wait: bool = True,
        log_name: str | None = None,
        stop_timeout: float = 30.0,
        cwd: Path = ROOT,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.health_path = health_path
        self.stop_timeout = stop_timeout
        self.port = port or free_port()  # a given port: a restart where clients already point
        self.base = f"http://127.0.0.1:{self.port}"
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = tmp / f"{log_name or f'kvserve-bench-{name}'}-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            make_cmd(self.port),
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until GET `health_path` answers 200; raises (with the log, process stopped) if the
        process exits or `timeout` s pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                message = f"{self.name} exited {self.proc.returncode} ({self.log_path}):\n"
                message += self.log()
                self.stop()
                raise RuntimeError(message)
            try:
                if httpx.get(self.base + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"{self.name} not ready after {timeout}s ({self.log_path}):\n{self.log()}"
        )

    def log(self) -> str:
        """Everything the process has written so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def model_id(self) -> str:
        """The first model the server lists (peers name their model differently)."""
        return httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kvserve_cmd(args: list[str], log_level: str | None = "warning") -> Cmd:
    """argv for kvserve itself on a given port: `python -m server --port P [--log-level L] ARGS`
    (log_level None: the server's own default)."""
    level = ("--log-level", log_level) if log_level else ()
    return lambda port: [sys.executable, "-m", "server", "--port", str(port), *level, *args]


class Server(Process):
    """kvserve itself (`python -m server ARGS`)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        timeout: float = 180.0,
        wait: bool = True,
        log_level: str | None = "warning",
        log_name: str | None = None,
        stop_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            "kvserve",
            kvserve_cmd(args, log_level),
            env,
            timeout=timeout,
            wait=wait,
            log_name=log_name,
            stop_timeout=stop_timeout,
        )
