"""kvserve processes for the tests, on bench/launch.py's launcher: `ServerProcess` (the server as
the tests run it), `kvserve_server` (its argv from keyword options) and `server_fixture` (a
pytest fixture factory on the tiny llama checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.launch import ROOT, Server, free_port

__all__ = ["ROOT", "ServerProcess", "free_port", "kvserve_server", "server_args", "server_fixture"]


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
