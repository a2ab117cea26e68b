"""Follow one request's data through the code: which project modules the HTTP side enters, in
order, for a chat completion, an Anthropic Messages call and a Responses call (non-streamed), on
the tiny random model the tests build. A *stay* is a run of consecutive calls inside one module; a
*return* is a stay in a module the request had already left. Few stays and few returns: a flow
that reads top to bottom. The engine thread is not followed (its step is the same for every
route), and the per-output loop is counted once (a lap repeated back to back is one lap).

    python -m tools.request_walk [--model DIR]   # from the checkout's root; default: a tiny
                                                 # random Llama in a temp dir
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLLOWED = ("server/", "engine/async_engine.py", "engine/core/engine_info.py")


def tiny_model(path: Path) -> Path:
    """The tests' tiny Llama checkpoint, written with their own helper."""
    from tests.conftest import build_model

    return build_model("llama", path / "llama")


class Recorder:
    """A profile hook on every thread (installed before the app's threads start); records the
    followed modules entered while `recording`, outside the engine thread."""

    def __init__(self) -> None:
        self.calls: list[str] | None = None

    def __call__(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        calls = self.calls
        if calls is None or event != "call":
            return
        if threading.current_thread().name == "kvserve-engine":
            return
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)):
            rel = Path(name).relative_to(ROOT).as_posix()
            if rel.startswith(FOLLOWED):
                calls.append(rel)

    def walk(self, client, path: str, body: dict) -> list[str]:  # noqa: ANN001
        """The modules entered (one entry per call) while `client` posts `body` to `path`."""
        self.calls = []
        try:
            r = client.post(path, json=body)
        finally:
            calls, self.calls = self.calls, None
        assert r.status_code == 200, r.text
        return calls


def collapse_cycles(stays: list[str], longest: int = 8) -> list[str]:
    """A run that repeats back to back (the per-output loop: one lap per token) counted once."""
    out: list[str] = []
    for module in stays:
        out.append(module)
        for n in range(1, min(longest, len(out) // 2) + 1):
            if out[-n:] == out[-2 * n : -n]:
                del out[-n:]
                break
    return out


def stays_and_returns(calls: list[str]) -> tuple[int, int, list[str]]:
    stays: list[str] = []
    for module in calls:
        if not stays or stays[-1] != module:
            stays.append(module)
    stays = collapse_cycles(stays)
    returns = sum(1 for i, m in enumerate(stays) if m in stays[:i])
    return len(stays), returns, stays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--show", action="store_true", help="print each stay")
    a = ap.parse_args()
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from server.app import build_app
    from server.config import Config, ServerConfig

    recorder = Recorder()
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(tiny_model(Path(tmp)))
        config = Config(ServerConfig(), EngineConfig(model=model, num_kv_blocks=64))
        with TestClient(build_app(config)) as client:
            while client.get("/health").status_code != 200:  # the model loads in a thread
                time.sleep(0.2)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            response = {"input": "hi", "max_output_tokens": 4}
            for name, path, body in (
                ("chat", "/v1/chat/completions", chat),
                ("messages", "/v1/messages", chat),  # the same body is a Messages request
                ("responses", "/v1/responses", response),
            ):
                recorder.walk(client, path, body)  # warm: lazy imports, caches
                n, back, stays = stays_and_returns(recorder.walk(client, path, body))
                print(f"{name}: {n} stays / {back} returns")
                if a.show:
                    print("   " + " -> ".join(s.split("/")[-1] for s in stays))


if __name__ == "__main__":
    main()
