"""`python -m server` / `kvserve`: serve a model over the OpenAI API."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse

# oneDNN keeps a compiled primitive per matmul shape it meets (default: up to 1,024 of them);
# a server meets a new row count at almost every prefill step, and that cache was most of its
# RSS growth under bench/soak.py (~7% in 5 minutes; 3% with 8 entries). Decode shapes repeat
# step after step and stay cached at 64. Read when oneDNN makes its first primitive: set here,
# before anything runs; an operator's own setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

import uvicorn  # noqa: E402

from server.config import Config, load_config  # noqa: E402

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.core.engine_info import EngineInfo


def kv_line(info: EngineInfo) -> str:
    """KV bytes per token, and what cross-layer sharing saves against one group per layer."""
    ours, unshared = info.kv_bytes_per_token, info.kv_bytes_per_token_unshared
    text = f"{ours} bytes in {info.num_kv_groups} KV groups ({info.num_layers} layers)"
    if unshared != ours:
        text += f", {unshared / ours:.2f}x fewer than unshared ({unshared} bytes)"
    if info.kv_bytes_per_token_full_context != ours:
        text += (
            f"; {info.kv_bytes_per_token_full_context} bytes a token at the full "
            f"{info.max_model_len}-token context (windowed groups keep their window only)"
        )
    if info.draft_layout is not None:
        text += f", + {info.draft_kv_bytes_per_token} for the draft head"
    return text


def banner(config: Config, info: EngineInfo) -> str:
    default_max = config.server.default_max_tokens
    lines = [
        "kvserve ready",
        f"  model      {info.model_path}",
        f"  arch       {info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}, "
        f"vocab {info.vocab_size}"
        + (f"; {info.architecture_traits}" if info.architecture_traits else ""),
        f"  dtype      {info.dtype} on {info.device} ({info.dtype_reason})"
        + (
            f", + {info.packed_weight_bytes / 2**20:.0f} MiB oneDNN-packed weight copies"
            if info.packed_weight_bytes
            else ""
        ),
        f"  KV cache   {info.num_blocks} blocks x {info.block_size} tokens = "
        f"{info.num_blocks * info.block_size} tokens "
        f"({info.kv_cache_bytes / 2**20:.0f} MiB), "
        f"prefix caching {'on' if info.prefix_caching else 'off'}",
        f"  KV/token   {kv_line(info)}" + (f"; {info.window_kv}" if info.window_kv else ""),
        f"  attention  {info.attention_backend} on {info.device_label}"
        + (" (decode: compiled C++ paged attention)" if info.compiled_decode else "")
        + (
            f" (prefill: C++ flash attention, {info.compiled_prefill})"
            if info.compiled_prefill
            else ""
        ),
        f"  context    {info.max_model_len} tokens, max {info.max_num_seqs} seqs, "
        f"{info.max_num_batched_tokens} tokens/step; chat max_tokens default: "
        + (f"{default_max}" if default_max else "the rest of the context"),
        f"  URL        http://{config.server.host}:{config.server.port}/v1"
        + ("  (API key required)" if config.server.api_key else ""),
    ]
    if info.draft_sources:
        head = f"; {info.draft_layout} head: {info.draft_source}" if info.draft_layout else ""
        lines.insert(
            -1,
            f"  speculate  drafts from {', '.join(info.draft_sources)},"
            f" k<={info.num_speculative_tokens}"
            f" (adaptive up to {info.spec_max_verify_rows} verify rows){head}"
            + (f"\n  corpus     {info.draft_corpus}" if info.draft_corpus else "")
            + (f"\n  step costs {info.spec_cost}" if info.spec_cost else ""),
        )
    if config.server.kv_store_url:
        lines.insert(-1, kv_store_line(config))
    lines += ["  kernel matrix:", info.kernel_table]
    return "\n".join(lines)


def kv_store_line(config: Config) -> str:
    """The remote KV store, and whether its values are authenticated: without a key every
    client of the store is trusted to write KV this server will serve, and the operator
    should see that at startup, not in a postmortem."""
    s = config.server
    url = urlparse(s.kv_store_url)  # without a password (redis://:PASSWORD@host)
    where = url._replace(netloc=url.netloc.rsplit("@", 1)[-1]).geturl()
    trust = (
        "values authenticated (HMAC-SHA256 with kv_store_key)"
        if s.kv_store_key
        else "TRUSTED, unauthenticated (no kv_store_key): any client of the store can feed "
        "this server KV; a digest catches corruption only"
    )
    return f"  KV store   {where} (role {s.role}); {trust}"


def kernels(argv: list[str]) -> int:
    """`python -m server kernels --model PATH`: the kernel-support matrix, without serving."""
    from engine.attention import DeviceFacts, kv_quant
    from engine.build.pool import block_size_for, configured_backend, kv_cache_dtype
    from models.loader import checkpoint_dtype, default_model_path, load_spec

    config = load_config(argv).engine
    path = config.model or default_model_path()
    spec = load_spec(path)
    device = config.resolved_device()
    facts = DeviceFacts.detect(device)
    dtype, why = config.dtype_choice(facts, checkpoint_dtype(path))
    try:
        kv_dtype, kv_why = kv_cache_dtype(config, dtype, device, spec)
    except ValueError as e:
        print(e)
        return 1
    elem = kv_quant.bytes_per_value(kv_dtype)
    print(
        f"model  {path}: {spec.architecture}, {spec.num_layers} layers, KV groups "
        f"{len(spec.kv_groups)}, {spec.kv_bytes_per_token(elem)} KV bytes/token"
    )
    print(f"device {facts.label}, dtype {str(dtype).replace('torch.', '')} ({why})")
    print(f"KV cache {kv_why}")
    block_size = block_size_for(config, spec, facts, dtype, device)
    print(f"block size {block_size} tokens")
    try:
        choice = configured_backend(config, spec, facts, dtype, block_size, kv_dtype)
    except ValueError as e:
        print(e)
        return 1
    print(choice.table)
    if config.tensor_parallel_size > 1:
        from models.tp_plan import plan_tensor_parallel

        try:
            plan = plan_tensor_parallel(spec, config.tensor_parallel_size)
        except ValueError as e:
            print(e)
            return 1
        print(plan.table(spec, elem))
    return 0


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["kernels"]:
        sys.exit(kernels(args[1:]))
    try:
        config = load_config(args)
    except ValueError as e:  # a bad setting: its reason in one line, as argparse does
        sys.exit(f"kvserve: error: {e}")
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
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        logging.getLogger("kvserve.server").critical("fatal: %s; shutting down", first_line)
        if server is not None and state.loop is not None:
            state.loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    def on_ready(engine: AsyncEngine) -> None:
        print(banner(config, engine.info), flush=True)

    app = build_app(config, on_fatal=on_fatal, on_ready=on_ready)
    state = app.state.kv
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
