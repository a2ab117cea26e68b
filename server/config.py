"""Startup configuration: `config.toml` < KVSERVE_* environment < command-line flags, merged
into one typed object (server settings + `EngineConfig`) that is passed down."""

from __future__ import annotations

import argparse
import logging
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, parse_bytes

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


_ZERO_IS_NONE = {"num_kv_blocks", "max_model_len", "block_size"}
_EMPTY_IS_NONE = {"model"}


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # one key, or several separated by commas
    salt_cache_per_key: bool = False
    served_model_name: str = ""
    allowed_origins: list[str] = field(default_factory=list)
    max_queue_len: int = 256
    max_body_bytes: int = 4_194_304
    max_n: int = 16
    max_top_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    # chat requests that name no max_tokens: 0 = the rest of the context (vLLM's behaviour)
    default_max_tokens: int = 0
    # tool-call format (vLLM's names: hermes, llama3_json, mistral); auto: from the chat template
    tool_call_parser: str = "auto"
    log_level: str = "info"
    request_timeout_s: float = 0.0  # abort a request running longer than this; 0 = off
    shutdown_grace_s: float = 30.0  # on SIGTERM, let in-flight requests finish this long
    idle_seconds: float = 0.0  # offload a session's KV to the host tier after this idle time
    # stored Responses (store: true): SQLite file ("" = <disk_path>/responses.sqlite3 with a
    # disk tier, else in memory), bounded by count and age (0 = unbounded)
    responses_db: str = ""
    responses_max_stored: int = 10_000
    responses_max_age_s: float = 30 * 24 * 3600.0
    # prefill/decode disaggregation (server/kv_transfer.py): both | prefill | decode
    role: str = "both"
    kv_store_url: str = ""  # redis://HOST:PORT[/DB] (Redis or Valkey); "" = no remote tier
    kv_store_ttl_s: int = 3600  # published blocks expire after this long; 0 = never


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible LLM server")
    ap.add_argument(
        "--config", default=None, help="TOML file of defaults (default: $KVSERVE_CONFIG, else "
        "the checkout's config.toml, else ./config.toml)"
    )  # fmt: skip
    for name, default in _defaults().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction)
        elif isinstance(default, list):
            ap.add_argument(flag, dest=name, default=None, nargs="*")
        else:
            kind = type(default) if default is not None else str
            if name in _ZERO_IS_NONE:
                kind = int
            ap.add_argument(flag, dest=name, default=None, type=kind)
    return ap


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    defaults = _defaults()
    values: dict[str, Any] = {}
    named = args.config or env.get("KVSERVE_CONFIG")
    path = Path(named) if named else default_config_path(env)
    if named and not Path(named).is_file():
        raise SystemExit(f"config file {named} not found")
    if path is None:
        logging.getLogger("kvserve.config").warning(
            "no config.toml found (KVSERVE_CONFIG unset, none in the checkout or ./): "
            "using built-in defaults"
        )
    elif path.is_file():
        with open(path, "rb") as f:
            for section in tomllib.load(f).values():
                if isinstance(section, dict):
                    values.update(section)
    unknown = set(values) - set(defaults)
    if unknown:
        raise SystemExit(f"{path}: unknown settings {sorted(unknown)}")
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
    if server.tool_call_parser not in ("auto", "hermes", "llama3_json", "mistral"):
        raise SystemExit(
            f"tool_call_parser {server.tool_call_parser!r}: choose auto, hermes, llama3_json "
            "or mistral"
        )
    if server.role not in ("both", "prefill", "decode"):
        raise SystemExit(f"role {server.role!r}: choose both, prefill or decode")
    if server.role != "both" and not server.kv_store_url:
        raise SystemExit(f"role {server.role} hands KV over through a store: set kv_store_url")
    if server.kv_store_url:
        if not engine.enable_prefix_caching:
            raise SystemExit("kv_store_url needs enable_prefix_caching (blocks are keyed by hash)")
        if parse_bytes(engine.host_bytes) == 0:
            # received blocks land in the host tier before a request's lookup meets them
            engine.host_bytes = "1GiB"
    if server.default_max_tokens < 0:
        raise SystemExit("default_max_tokens must be >= 0 (0: the rest of the context)")
    return Config(server, engine)
