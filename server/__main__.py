"""`python -m server` / `kvserve`: serve a model over the OpenAI API."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import uvicorn

from server.config import Config, load_config


def kv_line(engine) -> str:  # engine: LLMEngine
    """KV bytes per token, and what cross-layer sharing saves against one group per layer."""
    elem = engine.dtype_size
    spec = engine.spec
    ours, unshared = spec.kv_bytes_per_token(elem), spec.kv_bytes_per_token_unshared(elem)
    text = f"{ours} bytes in {len(spec.kv_groups)} KV groups ({spec.num_layers} layers)"
    if unshared != ours:
        text += f", {unshared / ours:.2f}x fewer than unshared ({unshared} bytes)"
    if engine.draft is not None:
        text += f", + {engine.pool_spec.kv_bytes_per_token(elem) - ours} for the draft head"
    return text


def banner(config: Config, engine) -> str:  # engine: LLMEngine
    spec = engine.spec
    lines = [
        "kvserve ready",
        f"  model      {engine.model_path}",
        f"  arch       {spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}",
        f"  dtype      {str(engine.dtype).replace('torch.', '')} on {engine.device}"
        + (
            f", + {engine.packed_weight_bytes / 2**20:.0f} MiB oneDNN-packed weight copies"
            if engine.packed_weight_bytes
            else ""
        ),
        f"  KV cache   {engine.num_blocks} blocks x {engine.block_size} tokens = "
        f"{engine.num_blocks * engine.block_size} tokens "
        f"({engine.num_blocks * engine.kv_block_bytes / 2**20:.0f} MiB), "
        f"prefix caching {'on' if engine.config.enable_prefix_caching else 'off'}",
        f"  KV/token   {kv_line(engine)}",
        f"  attention  {engine.backend_cls.name} on {engine.device_facts.label}"
        + (
            " (decode: compiled C++ paged attention)"
            if getattr(engine.runner.backend, "decode_op", None) is not None
            else ""
        ),
        f"  context    {engine.max_model_len} tokens, max {engine.config.max_num_seqs} seqs, "
        f"{engine.config.max_num_batched_tokens} tokens/step",
        f"  URL        http://{config.server.host}:{config.server.port}/v1"
        + ("  (API key required)" if config.server.api_key else ""),
    ]
    if engine.draft is not None:
        lines.insert(
            -1,
            f"  speculate  {engine.draft.cfg.layout} head, k={engine.config.num_speculative_tokens}"
            f" (adaptive up to {engine.config.spec_max_verify_rows} verify rows)",
        )
    lines += ["  kernel matrix:", engine.backend_choice.table]
    return "\n".join(lines)


def kernels(argv: list[str]) -> int:
    """`python -m server kernels --model PATH`: the kernel-support matrix, without serving."""
    import torch

    from engine.attention import DeviceFacts, select_backend
    from models.loader import default_model_path, load_spec

    config = load_config(argv).engine
    path = config.model or default_model_path()
    spec = load_spec(path)
    device = config.resolved_device()
    facts = DeviceFacts.detect(device)
    dtype = config.resolved_dtype()
    elem = torch.empty((), dtype=dtype).element_size()
    print(
        f"model  {path}: {spec.architecture}, {spec.num_layers} layers, KV groups "
        f"{len(spec.kv_groups)}, {spec.kv_bytes_per_token(elem)} KV bytes/token"
    )
    print(f"device {facts.label}, dtype {str(dtype).replace('torch.', '')}")
    try:
        choice = select_backend(
            spec, facts, dtype, config.resolved_block_size(), config.attention_backend,
            config.allow_slow_dtype, config.require_fast_kernels,
        )  # fmt: skip
    except ValueError as e:
        print(e)
        return 1
    print(choice.table)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["kernels"]:
        sys.exit(kernels(args[1:]))
    config = load_config(args)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from server.app import build_app

    exit_code = 0
    server: DrainingServer | None = None

    def on_fatal(error: BaseException) -> None:
        """The engine died or the model failed to load: exit non-zero so a supervisor restarts
        us, rather than hang with /health at 503."""
        nonlocal exit_code
        exit_code = 1
        logging.getLogger("kvserve.server").critical("fatal: %s; shutting down", error)
        if server is not None and state.loop is not None:
            state.loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    app = build_app(config, on_fatal=on_fatal)
    state = app.state.kv

    class BannerOnReady(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "model loaded: ready" and state.engine is not None:
                print(banner(config, state.engine.engine), flush=True)

    logging.getLogger("kvserve.server").addHandler(BannerOnReady())
    print(
        f"kvserve: loading {config.engine.model or 'SmolLM2-135M-Instruct (default)'}; "
        f"listening on http://{config.server.host}:{config.server.port}",
        flush=True,
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            timeout_graceful_shutdown=5,
        ),
        state,
        config.server.shutdown_grace_s,
    )
    server.run()
    sys.exit(exit_code)


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop admitting (503), let in-flight requests finish for up to the grace
    period, end the rest with an error event, then shut down (the lifespan flushes the KV tiers).
    A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, state, grace_s: float) -> None:  # state: ServerState
        super().__init__(config)
        self.state, self.grace_s = state, grace_s

    def handle_exit(self, sig: int, frame: object) -> None:
        state = self.state
        if state.draining or state.engine is None or state.loop is None:
            return super().handle_exit(sig, frame)
        state.draining = True
        logging.getLogger("kvserve.server").info(
            "signal %d: draining %d requests (up to %.0fs)",
            sig,
            state.engine.num_in_flight,
            self.grace_s,
        )
        state.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig, frame)))

    async def _drain(self, sig: int, frame: object) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.grace_s
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            engine.abort_all("the server is shutting down")
            await asyncio.sleep(0.2)  # let the error events reach their streams
        # Not super().handle_exit: uvicorn would re-raise the captured SIGTERM after shutdown
        # and the process would die by signal instead of exiting 0 after a clean drain.
        self.should_exit = True


if __name__ == "__main__":
    main()
