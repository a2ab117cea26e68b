"""Startup configuration: `config.toml` < KVSERVE_* environment < command-line flags, merged
into one typed object (server settings + `EngineConfig`) that is passed down."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import DEFAULT_HOST_BYTES, EngineConfig, parse_bytes, setting

# the tool-call formats server/flow/tool_parsers.py reads (its PARSERS)
PARSER_NAMES = ("hermes", "llama3_json", "mistral", "phi4_mini_json", "gemma4")

# The checkout's config.toml. An installed copy (site-packages) has none beside it: there
# KVSERVE_CONFIG names the file (the Docker image sets it), else ./config.toml is used if present.
CHECKOUT_CONFIG = Path(__file__).resolve().parent.parent / "config.toml"


def default_config_path(env: dict[str, str] | None = None) -> Path | None:
    """KVSERVE_CONFIG, else the checkout's config.toml, else ./config.toml; None if none exists
    (the built-in defaults, which mirror the shipped file, apply)."""
    env = dict(os.environ) if env is None else env
    if env.get("KVSERVE_CONFIG"):
        return Path(env["KVSERVE_CONFIG"])
    for path in (CHECKOUT_CONFIG, Path.cwd() / "config.toml"):
        if path.is_file():
            return path
    return None


# config.toml's sections and the settings each holds. A setting is read from its own section only:
# flattened, `[server] max_num_seqs = 8` took effect as if it sat under [engine], so the
# sections told a reader nothing and a key pasted in the wrong place was silently obeyed.
# tests/test_config.py holds this table, the settings and the shipped config.toml together.
SECTIONS: dict[str, list[str]] = {
    "server": (
        "host port api_key salt_cache_per_key served_model_name allowed_origins max_queue_len "
        "max_body_bytes max_n max_top_logprobs max_stop_sequences max_stop_length "
        "default_max_tokens tool_call_parser reasoning_parser log_level request_timeout_s "
        "app_cache_stats max_grammar_compile_s grammar_compile_workers shutdown_grace_s "
        "allowed_media_domains max_images_per_request max_image_bytes max_image_pixels "
        "min_image_side"
    ).split(),
    "model": (
        "model mmproj dtype quantization gguf_int8_activations gguf_int8_prefill "
        "cpu_packed_weights kv_cache_dtype device max_model_len"
    ).split(),
    "engine": (
        "max_num_seqs max_num_batched_tokens scheduling short_prefill_tokens target_step_ms "
        "max_itl_factor kv_pin_share seed tensor_parallel_size tensor_parallel_allreduce "
        "tensor_parallel_timeout_s pooling"
    ).split(),
    "cache": (
        "block_size num_kv_blocks kv_cache_memory gpu_memory_utilization enable_prefix_caching "
        "reclaim_window_blocks encoder_cache_bytes"
    ).split(),
    "offload": "host_bytes idle_seconds disk_path disk_bytes preemption_mode".split(),
    "responses": "responses_db responses_max_stored responses_max_age_s".split(),
    "kv_transfer": "role kv_store_url kv_store_ttl_s kv_store_key kv_hash_seed".split(),
    "speculative": (
        "speculative_model num_speculative_tokens speculative_method speculative_corpus "
        "spec_max_verify_rows spec_cost_model"
    ).split(),
    "lora": "lora_modules max_loras max_lora_rank".split(),
    "attention": "attention_backend allow_slow_dtype require_fast_kernels enforce_eager".split(),
}
HOME = {key: section for section, keys in SECTIONS.items() for key in keys}  # setting -> section


def _did_you_mean(word: str, known: list[str], where: dict[str, str] | None = None) -> str:
    """A hint naming the closest known name (and its section, from `where`), or ""."""
    close = difflib.get_close_matches(word, known, n=1)
    if not close:
        return ""
    section = f" in [{where[close[0]]}]" if where else ""
    return f" (did you mean {close[0]}{section}?)"


def _misplaced(key: str, where: str) -> str:
    """What is wrong with `key` found `where` ("[section]", or outside every section)."""
    if key in HOME:
        return f"{where} {key} belongs in [{HOME[key]}]"
    return f"{where} {key}: unknown setting" + _did_you_mean(key, list(HOME), HOME)


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings of a config.toml, each taken from its own section (`SECTIONS`). Every key
    that is misplaced (in another section, or above every section header), unknown, or under an
    unknown section is reported at once, each line naming the fix, and none is applied: a
    half-read file would serve with settings its author did not mean."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"{path}: {e}") from None
    values: dict[str, Any] = {}
    errors: list[str] = []
    for section, body in document.items():
        if not isinstance(body, dict):  # `key = value` above the first [section] header
            errors.append(_misplaced(section, "outside every section:"))
        elif section not in SECTIONS:
            hint = _did_you_mean(f"[{section}]", [f"[{name}]" for name in SECTIONS])
            errors.append(f"unknown section [{section}]{hint}")
        else:
            for key, value in body.items():
                if HOME.get(key) == section:
                    values[key] = value
                else:
                    errors.append(_misplaced(key, f"[{section}]"))
    if errors:
        raise SystemExit("\n".join(f"{path}: {e}" for e in errors))
    return values


_ZERO_IS_NONE = {"num_kv_blocks", "max_model_len", "block_size"}
_EMPTY_IS_NONE = {"model"}


@dataclass(slots=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_key: str = setting("", "the API key clients must send; several separated by commas")
    salt_cache_per_key: bool = setting(
        False, "tenants holding different API keys never share prefix-cache blocks"
    )
    served_model_name: str = setting("", "the model name clients use (default: from the path)")
    allowed_origins: list[str] = field(
        default_factory=list, metadata={"help": "CORS origins allowed", "choices": None}
    )
    max_queue_len: int = setting(256, "requests waiting beyond max_num_seqs before 429s")
    max_body_bytes: int = setting(4_194_304, "largest request body accepted")
    max_n: int = setting(16, "largest n (choices per prompt)")
    max_top_logprobs: int = setting(20, "largest top_logprobs (logprobs on completions)")
    max_stop_sequences: int = setting(16, "most stop sequences per request")
    max_stop_length: int = setting(256, "longest stop sequence, in characters")
    default_max_tokens: int = setting(
        0, "output cap of chat requests that name none; 0: the rest of the context (vLLM's)"
    )
    tool_call_parser: str = setting(
        "auto",
        "tool-call format (vLLM's names); auto: from the chat template",
        ("auto", *PARSER_NAMES),
    )
    reasoning_parser: str = setting(
        "auto",
        "thoughts apart from answers (<think>...</think>); auto: when the chat template thinks",
        ("auto", "none"),
    )
    log_level: str = setting("info", "log level", ("debug", "info", "warning", "error", "critical"))
    request_timeout_s: float = setting(0.0, "abort a request running longer than this; 0: off")
    app_cache_stats: bool = setting(
        True, "per-application prefix-cache hit rates and the cache-breaker detector (/v1/stats)"
    )
    max_grammar_compile_s: float = setting(
        5.0, "a grammar (schema, regex, EBNF, tools) not compiled within this is a 400; 0: no limit"
    )
    grammar_compile_workers: int = setting(
        0, "grammars compiled at once (worker processes); 0: one fewer than the cores"
    )
    shutdown_grace_s: float = setting(30.0, "on SIGTERM, let in-flight requests finish this long")
    allowed_media_domains: list[str] = field(
        default_factory=list,
        metadata={
            "help": "hosts an image URL may be fetched from (an image_url that is not a data: "
            "URL); empty: none, remote images are refused",
            "choices": None,
        },
    )
    max_images_per_request: int = setting(8, "most images in one request")
    max_image_bytes: int = setting(10_485_760, "largest image file accepted, in bytes")
    max_image_pixels: int = setting(
        33_554_432, "largest image accepted, width x height (checked before decoding)"
    )
    min_image_side: int = setting(2, "images narrower or shorter than this many pixels are refused")
    idle_seconds: float = setting(
        0.0, "offload a session's KV to the host tier after this long idle; 0: off"
    )
    responses_db: str = setting(
        "",
        "SQLite file of stored Responses (store: true); empty: <disk_path>/responses.sqlite3 "
        "with a disk tier, else in memory",
    )
    responses_max_stored: int = setting(10_000, "most stored responses; 0: unbounded")
    responses_max_age_s: float = setting(
        30 * 24 * 3600.0, "stored responses expire after this long; 0: never"
    )
    role: str = setting(
        "both",
        "prefill/decode disaggregation (server/kv_transfer.py): prefill publishes every "
        "prompt's KV, decode fetches it, both does either when kv_transfer_params asks",
        ("both", "prefill", "decode"),
    )
    kv_store_url: str = setting(
        "", "remote KV tier: redis://HOST:PORT[/DB] (Redis or Valkey); empty: none"
    )
    kv_store_ttl_s: int = setting(3600, "published blocks expire after this long; 0: never")
    kv_store_key: str = setting(
        "",
        "secret shared by every instance of the KV store: values are authenticated "
        "(HMAC-SHA256) and one written without it is refused; empty: the store is trusted. "
        "Prefer KVSERVE_KV_STORE_KEY (a flag shows in the process list)",
    )


@dataclass(slots=True)
class Config:
    server: ServerConfig
    engine: EngineConfig


def _coerce(value: str, default: Any) -> Any:
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if isinstance(default, list):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in (ServerConfig, EngineConfig):
        inst = cls()
        out.update({f.name: getattr(inst, f.name) for f in fields(cls)})
    return out


def _metadata() -> dict[str, Any]:
    return {f.name: f.metadata for cls in (ServerConfig, EngineConfig) for f in fields(cls)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible LLM server")
    ap.add_argument(
        "--config",
        default=None,
        help="TOML file of defaults (default: $KVSERVE_CONFIG, else "
        "the checkout's config.toml, else ./config.toml)",
    )
    meta = _metadata()
    for name, default in _defaults().items():
        flag = "--" + name.replace("_", "-")
        shown = "none" if default is None else default
        text = f"{meta[name]['help']} (default: {shown})"
        choices = meta[name]["choices"]
        if isinstance(default, bool):
            ap.add_argument(
                flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=text
            )
        elif isinstance(default, list):
            ap.add_argument(flag, dest=name, default=None, nargs="*", help=text)
        else:
            kind = type(default) if default is not None else str
            if name in _ZERO_IS_NONE:
                kind = int
            ap.add_argument(flag, dest=name, default=None, type=kind, choices=choices, help=text)
    return ap


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    defaults = _defaults()
    values: dict[str, Any] = {}
    named = args.config or env.get("KVSERVE_CONFIG")
    path = Path(named) if named else default_config_path(env)
    if named and not Path(named).is_file():
        source = "--config" if args.config else "KVSERVE_CONFIG"
        raise SystemExit(f"config file {named} ({source}) not found")
    if path is None:
        logging.getLogger("kvserve.config").warning(
            "no config.toml found (KVSERVE_CONFIG unset, none in the checkout or ./): "
            "using built-in defaults"
        )
    else:
        values.update(read_config_file(path))
    for name, default in defaults.items():
        raw = env.get("KVSERVE_" + name.upper())
        if raw is not None:
            values[name] = _coerce(raw, default if default is not None else "")
        flag = getattr(args, name)
        if flag is not None:
            values[name] = flag
    for name in _ZERO_IS_NONE:
        if values.get(name) == 0:
            values[name] = None
    for name in _EMPTY_IS_NONE:
        if values.get(name) == "":
            values[name] = None
    server = ServerConfig(**{k: v for k, v in values.items() if k in ServerConfig.__slots__})
    engine = EngineConfig(**{k: v for k, v in values.items() if k in EngineConfig.__slots__})
    engine.validate()
    if server.tool_call_parser not in ("auto", *PARSER_NAMES):
        raise SystemExit(
            f"tool_call_parser {server.tool_call_parser!r}: choose auto, " + ", ".join(PARSER_NAMES)
        )
    if server.role not in ("both", "prefill", "decode"):
        raise SystemExit(f"role {server.role!r}: choose both, prefill or decode")
    if server.role != "both" and not server.kv_store_url:
        raise SystemExit(f"role {server.role} hands KV over through a store: set kv_store_url")
    if server.kv_store_url and engine.tensor_parallel_size > 1:
        raise SystemExit(
            "kv_store_url with tensor_parallel_size > 1: the store's blocks are whole, each "
            "rank holds a shard of them; serve P/D or replicas with one rank each"
        )
    if server.kv_store_key and not server.kv_store_url:
        raise SystemExit("kv_store_key without kv_store_url: there is no store to authenticate")
    if server.kv_store_url:
        if not engine.enable_prefix_caching:
            raise SystemExit("kv_store_url needs enable_prefix_caching (blocks are keyed by hash)")
        if parse_bytes(engine.host_bytes) == 0:
            # received blocks land in the host tier before a request's lookup meets them
            engine.host_bytes = DEFAULT_HOST_BYTES
    if server.default_max_tokens < 0:
        raise SystemExit("default_max_tokens must be >= 0 (0: the rest of the context)")
    return Config(server, engine)
