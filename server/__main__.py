"""`python -m server` / `kvserve`: serve a model over the OpenAI API."""

from __future__ import annotations

import logging
import sys

import uvicorn

from server.config import Config, load_config


def banner(config: Config, engine) -> str:  # engine: LLMEngine
    spec = engine.spec
    lines = [
        "kvserve ready",
        f"  model      {engine.model_path}",
        f"  arch       {spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}",
        f"  dtype      {str(engine.dtype).replace('torch.', '')} on {engine.device}",
        f"  KV cache   {engine.num_blocks} blocks x {engine.block_size} tokens = "
        f"{engine.num_blocks * engine.block_size} tokens "
        f"({engine.num_blocks * engine.kv_block_bytes / 2**20:.0f} MiB), "
        f"prefix caching {'on' if engine.config.enable_prefix_caching else 'off'}",
        f"  attention  {engine.backend_cls.name}",
        f"  context    {engine.max_model_len} tokens, max {engine.config.max_num_seqs} seqs, "
        f"{engine.config.max_num_batched_tokens} tokens/step",
        f"  URL        http://{config.server.host}:{config.server.port}/v1"
        + ("  (API key required)" if config.server.api_key else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    config = load_config(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from server.app import build_app

    app = build_app(config)
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
    uvicorn.run(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
