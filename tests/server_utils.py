"""kvserve processes for the tests, on harness/launch.py's launcher: `ServerProcess` (the server as
the tests run it), `kvserve_server` (its argv from keyword options) and `server_fixture` (a
pytest fixture factory on the tiny llama checkpoint)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from harness.launch import ROOT, Server, free_port
from server.app import build_app
from server.config import Config, ServerConfig

__all__ = [
    "ROOT",
    "InProcessServer",
    "ServerProcess",
    "free_port",
    "kvserve_server",
    "nan_logits",
    "server_args",
    "server_fixture",
]


def nan_logits(monkeypatch: pytest.MonkeyPatch, runner: object) -> None:
    """Every forward of `runner` yields NaN logits from now on (the test's monkeypatch undoes
    it): a generation failure inside the engine, the same for every request."""
    original = runner.forward  # type: ignore[attr-defined]

    def forward(out):  # noqa: ANN001, ANN202
        logits, hidden, plan = original(out)
        return torch.full_like(logits, float("nan")), hidden, plan

    monkeypatch.setattr(runner, "forward", forward)


class InProcessServer:
    """uvicorn in a thread over an engine the test holds (`.core`), for injecting faults into
    the live engine; the server sees only the AsyncEngine door. `server` options go to
    ServerConfig."""

    def __init__(
        self,
        model_dir: str | Path,
        max_model_len: int = 512,
        engine: dict[str, object] | None = None,
        **server: object,
    ) -> None:
        """`engine`: EngineConfig overrides."""
        self.fatal: list[BaseException] = []
        options = {"num_kv_blocks": 128, "max_model_len": max_model_len, **(engine or {})}
        self.core = LLMEngine(EngineConfig(model=str(model_dir), **options))  # type: ignore[arg-type]
        self.engine = AsyncEngine(self.core)
        config = Config(ServerConfig(**server), self.core.config)  # type: ignore[arg-type]
        app = build_app(config, engine=self.engine, on_fatal=self.fatal.append)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


class ServerProcess(Server):
    """`python -m server --port P ARGS` at the server's own log level, on 127.0.0.1, ready when
    /health is 200 (within `timeout` s; `wait=False` returns at once, then `wait_ready`). `.base`,
    `.port`, `.proc`, `.log()` (its output so far, from $TMPDIR/kvserve-P.log); `stop()`
    returns the exit code."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        wait: bool = True,
        timeout: float = 120.0,
    ) -> None:
        super().__init__(
            args,
            env,
            timeout=timeout,
            wait=wait,
            log_level=None,
            log_name="kvserve",
            stop_timeout=15.0,
        )


def server_args(model_dir: str | Path, **options: object) -> list[str]:
    """`--model DIR`, then each option in order as `--its-name VALUE` (True: a bare flag;
    False or None: left out)."""
    args = ["--model", str(model_dir)]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        elif value is not False and value is not None:
            args += [flag, str(value)]
    return args


def kvserve_server(
    model_dir: str | Path,
    *,
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout: float = 120.0,
    **options: object,
) -> ServerProcess:
    """A started kvserve on `model_dir` with these server options (see `server_args`), e.g.
    `kvserve_server(llama_dir, num_kv_blocks=64, api_key="k1,k2", salt_cache_per_key=True)`;
    a context manager that stops it."""
    return ServerProcess(server_args(model_dir, **options), env=env, wait=wait, timeout=timeout)


def server_fixture(scope: str = "module", **options: object):
    """A pytest fixture yielding `kvserve_server(llama_dir, **options)`, stopped after `scope`:
    `server = server_fixture(num_kv_blocks=128, block_size=16)` in a test module."""

    @pytest.fixture(scope=scope)
    def server(llama_dir: Path):
        with kvserve_server(llama_dir, **options) as s:
            yield s

    return server
